//! The CUDA backend: kernels from `kernels/*.cu` compiled by NVRTC for the device in hand, cuBLAS
//! GEMMs, weights streamed from the checkpoint's mmap through pinned staging buffers.
//!
//! What runs here: weight dequantization (NVFP4 both conventions, MXFP4, FP8 block, dense), the
//! served path's activation quantization (NVFP4 in the serving kernel's op order with
//! `rcp.approx.ftz`, FP8 1×128), every linear of every path (FP32 oracle: FP32 GEMM without TF32;
//! BF16 oracle and the served GEMMs: BF16 × BF16 → FP32 where both operands are exactly BF16),
//! the whole routed-experts op (gather, SwiGLU clamp, combine in the CPU reference's order) and
//! the fused per-tensor statistics. The remaining op math runs on the host in `model::exec`.
//!
//! Weights are uploaded once per op as stored (4-bit, 8-bit) and dequantized on the device for
//! each path, so an expert is read from disk once however many paths use it.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{
    result as dres, sys as dsys, CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream,
    DevicePtr, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::checkpoint::Checkpoint;
use crate::metrics::{Compare, PairSums, Stats};
use crate::numerics::nvfp4::{Convention, QuantHealth};
use crate::served::faults::Fault;
use crate::served::PathKind;
use crate::served::{
    self, ActQuant, LinearObs, Nvfp4Params, Override, Profile, ServedWeight, WeightOperand,
};
use crate::tensor::Data;
use crate::{Error, Result, Tensor};

mod experts;
pub mod image;

pub use image::KERNEL_SOURCE;

const KERNELS: &[&str] = &[
    "decode_bytes",
    "encode_floats",
    "round_bf16",
    "count_inexact_bf16",
    "scale_round",
    "rcp_approx_map",
    "rcp_sweep",
    "rcp_table",
    "dequant_nvfp4",
    "dequant_nvfp4_v2",
    "dequant_mxfp4",
    "dequant_fp8_block",
    "convert_dense",
    "act_quant_nvfp4",
    "act_quant_nvfp4_v2",
    "act_quant_nvfp4_v3",
    "act_quant_nvfp4_seg",
    "act_quant_fp8",
    "fused_stats",
    "stats_pick",
    "gather_rows",
    "swiglu_clamp",
    "moe_combine",
    "to_f64",
    "from_f64",
    "gemm_small_f64",
    "moe_gemm_f64",
    "row_rms",
    "rms_apply",
    "rope_rows",
    "hc_coeffs",
    "hc_wsum",
    "hc_post",
    "attn_core",
    "compress_pool",
    "indexer_scores",
    "route_topk",
    "add_f32",
];

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

/// Health slots per served linear (7 counters + the activation amax as f32 bits).
pub const H_SLOTS: usize = 8;

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("cuda: {what}: {e:?}"))
}

/// Device memory: allocated on the compute stream (freed in its order), or staged by the loader
/// thread (handed back to it, freed once the compute stream is past its last use).
pub enum Mem {
    Own(CudaSlice<u8>),
    Staged(super::stage::Lease),
}

/// A device allocation with its raw address (event tracking is off: one stream orders everything,
/// and the loader's copies are ordered by events, `stage`).
pub struct Buf {
    /// The allocation; shared by the pieces of one arena (`Gpu::preload`, the loader's batches),
    /// freed with the last.
    _s: std::sync::Arc<Mem>,
    pub ptr: u64,
    pub bytes: usize,
}

impl Buf {
    /// A piece `[ptr, ptr + bytes)` of a shared allocation.
    pub(crate) fn shared(m: &Arc<Mem>, ptr: u64, bytes: usize) -> Buf {
        Buf {
            _s: m.clone(),
            ptr,
            bytes,
        }
    }
}

/// A pinned host buffer that small device → host reads land in ([`BOUNCE`] bytes). A read into
/// pageable memory is synchronous inside the driver, and while the GPU works off a long queue it
/// held up the loader thread's driver calls (30-35 ms per Flash layer on the H200); into pinned
/// memory the copy is asynchronous and the host waits with a stream synchronization.
pub struct Bounce {
    ptr: *mut u8,
    lock: Mutex<()>,
    ctx: Arc<CudaContext>,
}

// SAFETY: the buffer is only touched under `lock`
unsafe impl Send for Bounce {}
unsafe impl Sync for Bounce {}

const BOUNCE: usize = 1 << 20;

impl Bounce {
    fn new(ctx: &Arc<CudaContext>) -> Result<Bounce> {
        let p = unsafe { dres::malloc_host(BOUNCE, 0) }.map_err(|e| cuda_err("pinned", e))?;
        Ok(Bounce {
            ptr: p as *mut u8,
            lock: Mutex::new(()),
            ctx: ctx.clone(),
        })
    }

    /// The values at `src` into `out` through the pinned buffer, a [`BOUNCE`]-byte piece at a
    /// time; waits for `stream`.
    fn read<T: Copy>(
        &self,
        stream: &CudaStream,
        src: u64,
        out: &mut [T],
    ) -> std::result::Result<(), String> {
        let bytes = std::mem::size_of_val(out);
        // SAFETY: a byte view of `out` (plain values; every bit pattern is written by the copy)
        let dst = unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, bytes) };
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        for (i, piece) in dst.chunks_mut(BOUNCE).enumerate() {
            let pin = unsafe { std::slice::from_raw_parts_mut(self.ptr, piece.len()) };
            let at = src + (i * BOUNCE) as u64;
            unsafe { dres::memcpy_dtoh_async(pin, at, stream.cu_stream()) }
                .map_err(|e| format!("cuda: copy to host: {e:?}"))?;
            stream
                .synchronize()
                .map_err(|e| format!("cuda: kernel execution: {e:?}"))?;
            piece.copy_from_slice(pin);
        }
        Ok(())
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        unsafe {
            let _ = dres::free_host(self.ptr as _);
        }
    }
}

/// A tensor's values in device memory, produced by a device op or uploaded once from the host
/// (`Gpu::input`); read-only. `Data` fetches them to the host only when host code reads them.
pub struct DevTensor {
    buf: Buf,
    n: usize,
    stream: Arc<CudaStream>,
    bounce: Arc<Bounce>,
}

impl crate::tensor::DeviceValues for DevTensor {
    fn ptr(&self) -> u64 {
        self.buf.ptr
    }
    fn len(&self) -> usize {
        self.n
    }
    fn owner(&self) -> usize {
        Arc::as_ptr(&self.stream) as *const u8 as usize
    }
    fn to_host(&self) -> std::result::Result<Vec<f32>, String> {
        let _s = crate::profile::span("host: device values read by host code");
        let mut v = vec![0f32; self.n];
        if self.n > 0 {
            self.bounce.read(&self.stream, self.buf.ptr, &mut v)?;
        } else {
            self.stream
                .synchronize()
                .map_err(|e| format!("cuda: kernel execution: {e:?}"))?;
        }
        Ok(v)
    }
}

/// A device address that stays valid while this lives (it holds the values' allocation).
pub struct DevRef {
    pub ptr: u64,
    _keep: Arc<dyn crate::tensor::DeviceValues>,
}

/// The routed-experts op's output, the served observations per expert linear (sub id, what it
/// saw), the weight bases it read, and per expert that received tokens (in expert order) the
/// amax of the activation its w2 was fed (whatever the path; NaN-ignoring, as the CPU's fold).
pub type ExpertsOut = (
    Tensor,
    Vec<(String, LinearObs)>,
    Vec<String>,
    Vec<(usize, f32)>,
);

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

/// A kernel argument.
#[derive(Clone, Copy)]
pub enum A {
    P(u64),
    U(u64),
    I(i32),
    F(f32),
    U32(u32),
}

/// Which weight rows a linear uses.
#[derive(Clone, Copy, Debug)]
enum WRows {
    All,
    /// Rows r0..r0 + n.
    Range(usize, usize),
    /// G equal slices, each multiplying its own block of activation rows.
    Groups(usize),
}

/// Which element type a GEMM operand holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ty {
    F32,
    Bf16,
}

/// The weight as stored, resident on the device for the current op.
enum DevFmt {
    Dense(Buf),
    Fp8 {
        bytes: Buf,
        scales: Buf,
        bm: usize,
        bn: usize,
    },
    Mx {
        packed: Buf,
        scales: Buf,
    },
    Nv {
        packed: Buf,
        scales: Buf,
        conv: Convention,
        global: f32,
    },
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
/// The grouped experts op takes experts of up to this many rows; an op where some expert sees
/// more tokens runs per expert (cuBLAS DGEMM for its many rows, one weight read per expert).
const GROUPED_MAX_ROWS: usize = 64;
/// Rows per [`MoeTile`] (`MOE_R` in kernels/stats.cu).
pub const MOE_R: usize = 4;
/// Output columns per CUDA block of `moe_gemm_f64` (`MOE_C`).
const MOE_C: usize = 8;
pub const MT_POST: u32 = 4;
pub const MT_SWAP: u32 = 8;
pub const MT_WBF16: u32 = 16;
pub const MT_EPI: u32 = 32;

/// The `act_quant_nvfp4_seg` segments of rows (first row, row count) of a [.., k] activation:
/// segment i with encode scale `g(i)` and counters at `health(i)`.
fn aq_segs(
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

/// What one path multiplies a routed expert linear's weight with, in the grouped experts op.
#[derive(Clone, Copy, Debug, PartialEq)]
enum MoeAct {
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
    /// FP8 1×128 fake quantization (served MXFP4 experts).
    Fp8 { non_pow2: bool },
}

/// How the served path computes with a weight.
enum ServedDev {
    /// From the stored bytes: NVFP4 scalars as the loader resolved them (scalar loader faults and
    /// hypotheses applied), nibble order, FP8 activation-scale and double-scale faults as flags.
    Native {
        nv: Option<Nvfp4Params>,
        swap: bool,
        non_pow2: bool,
        double_scale: bool,
        /// NVFP4 block-scale bytes the served reading decodes with instead of the stored ones
        /// (layout faults and repairs, bisect's re-read stored scales), linear [n, k/16], and
        /// what they were computed from (reused while that stays the same).
        scales: Option<(Buf, String)>,
    },
    /// Prepared on the host (a loader fault or a bisect hypothesis touches this weight).
    Host {
        w: Buf,
        nv: Option<Nvfp4Params>,
        fp8_act: bool,
        non_pow2: bool,
        dense: bool,
    },
}

struct DevWeight {
    n: usize,
    k: usize,
    fmt: DevFmt,
    served: ServedDev,
    /// What the served reading was computed from ([`served_key`]): a later call with other
    /// faults or hypotheses for this base recomputes the served reading and keeps the bytes.
    /// None: installed by [`Gpu::pin_nvfp4_served`], kept until [`Gpu::forget_served`].
    served_key: Option<String>,
}

/// What an NVFP4 weight's rearranged block scales depend on: its layout faults and repairs.
fn layout_key(faults: &[&Fault], overrides: &[Override]) -> String {
    use crate::served::faults::FaultKind as K;
    let f: Vec<&K> = faults
        .iter()
        .map(|f| &f.kind)
        .filter(|k| {
            matches!(
                k,
                K::SwizzledScales | K::ShiftedScaleRows | K::NanBlockScale
            )
        })
        .collect();
    let o: Vec<&Override> = overrides
        .iter()
        .filter(|o| matches!(o, Override::Unswizzle | Override::UnshiftRows))
        .collect();
    format!("{f:?}{o:?}")
}

/// The loader faults, hypotheses and pair fusion that decide a base's served reading.
fn served_key(lc: &LinearCtx, base: &str) -> String {
    let faults = crate::served::faults::hitting(lc.faults, base);
    let ovs = served::overrides_of(lc.overrides, base);
    if faults.is_empty() && ovs.is_empty() {
        return if lc.fuse_pairs { "f" } else { "-" }.to_string();
    }
    format!("{}{faults:?}{ovs:?}", lc.fuse_pairs)
}

/// What the served linear needs from the run: checkpoint, profile, loader faults, hypotheses.
pub struct LinearCtx<'a> {
    pub ckpt: &'a Checkpoint,
    pub profile: Profile,
    pub fuse_pairs: bool,
    pub faults: &'a [Fault],
    pub overrides: &'a [(String, Override)],
}

/// Device timing and traffic counters (for benchmarks).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct GpuCounters {
    pub bytes_uploaded: u64,
    pub upload_seconds: f64,
    pub linears: u64,
    pub expert_ops: u64,
    /// Routed-experts ops run as grouped launches (the rest ran per expert).
    pub grouped_expert_ops: u64,
    pub metric_passes: u64,
}

/// Device time per kernel, cuBLAS call and copy, from CUDA events recorded around every one
/// (`NVFP4_PROBE_KERNEL_TIME=1`): the GPU work of a run without the host's gaps between launches.
#[derive(Default)]
pub struct KernelTimer {
    free: Vec<CudaEvent>,
    pending: Vec<(CudaEvent, CudaEvent, &'static str, usize)>,
    by_kernel: HashMap<&'static str, (u64, f64)>,
    /// Device milliseconds and calls by (the runner's op step when enqueued, kernel).
    by_step_kernel: HashMap<(usize, &'static str), (u64, f64)>,
}

impl KernelTimer {
    fn drain(&mut self) -> Result<()> {
        for (a, b, name, step) in self.pending.drain(..) {
            let ms = a.elapsed_ms(&b).map_err(|e| cuda_err("event timing", e))?;
            let e = self.by_kernel.entry(name).or_default();
            e.0 += 1;
            e.1 += ms as f64;
            let e = self.by_step_kernel.entry((step, name)).or_default();
            e.0 += 1;
            e.1 += ms as f64;
            self.free.push(a);
            self.free.push(b);
        }
        Ok(())
    }
}

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    funcs: HashMap<&'static str, CudaFunction>,
    pub device_name: String,
    pub arch: String,
    pub compile_seconds: f64,
    /// Where the kernels' code came from: shipped CUBIN, cached PTX or NVRTC.
    pub kernels_from: &'static str,
    sm_count: u32,
    weights: HashMap<String, DevWeight>,
    files: HashMap<std::path::PathBuf, std::fs::File>,
    /// Tensors read ahead of `ensure_weight` in one batch, by (file, offset).
    preloaded: HashMap<(std::path::PathBuf, u64), Buf>,
    scratch: HashMap<&'static str, Buf>,
    /// The pinned staging buffers in use (2 × [`STAGE`], or the small set while the large one is
    /// lent to a run's loader thread: [`Gpu::lend_pinned`]).
    pinned: Vec<(*mut u8, usize, CudaEvent)>,
    /// The other set: the small one, or the large one while lent.
    pinned_spare: Vec<(*mut u8, usize, CudaEvent)>,
    /// Whether the large set is lent out.
    lent: bool,
    pub counters: GpuCounters,
    /// Accumulate every GEMM in f64 (bit-equal to the CPU reference); false = hardware GEMMs.
    pub exact64: bool,
    /// Launch the faster `dequant_nvfp4_v2` / `aq_kernel` (same arguments, same output
    /// bits) instead of the v1 kernels. True unless `NVFP4_PROBE_KERNELS=v1` was set when the
    /// backend opened; the self-test flips it to check both.
    pub v2: bool,
    /// The activation quantization kernel used when `v2` (one of [`AQ_KERNELS`]).
    pub aq_kernel: &'static str,
    /// Run a routed-experts op of NVFP4 experts as a few grouped launches (`moe_gemm_f64`,
    /// `act_quant_nvfp4_seg`) instead of a launch sequence per expert. True unless
    /// `NVFP4_PROBE_EXPERTS=loop` was set when the backend opened.
    pub grouped_experts: bool,
    /// Group MXFP4 experts too. True unless `NVFP4_PROBE_EXPERTS=loop-mx` (MXFP4 experts per
    /// expert, NVFP4 grouped) or `loop`: whole MXFP4-expert runs of the tiny model matched the
    /// CPU reference under every profile through the grouped kernel on the H200.
    pub grouped_mx: bool,
    /// The pinned buffer small device → host reads go through.
    bounce: Arc<Bounce>,
    /// Per-launch device timing, when `NVFP4_PROBE_KERNEL_TIME=1` was set at open.
    ktimer: Option<std::cell::RefCell<KernelTimer>>,
    /// The loader thread's staged weights, while a run has one (`stage`).
    pub stager: Option<Arc<super::stage::Stager>>,
    /// Pinned host slots the metrics' results are copied into ([`Gpu::metrics_launch`]): the
    /// blocks (freed on drop) and the free slots' addresses.
    metric_blocks: Vec<*mut u8>,
    metric_free: Vec<usize>,
    /// Served NVFP4 readings with rearranged block scales, computed in parallel for the routed
    /// experts of one `experts` call ([`Gpu::prepare_layouts`]) and consumed by `served_reading`.
    prepared: HashMap<String, PreparedLayout>,
    /// Routed-experts ops only begin, until [`Gpu::experts_flush`] (`experts`).
    defer: bool,
    deferred: Vec<experts::ExpertsJob>,
    /// Experts per chunk of a flush ([`experts::expert_chunk_from_env`]; 0 = never defer).
    pub expert_chunk: usize,
}

/// `served::nvfp4_served_bytes`' result: rearranged scale bytes, nibble order, scalars.
type PreparedLayout = (Option<Vec<u8>>, bool, Nvfp4Params);

/// Bytes of one pinned metrics slot: room for [`METRIC_SLOT`] / 8 / [`STAT_WORDS`] pairs.
const METRIC_SLOT: usize = 8 << 10;
/// Slots per pinned block.
const METRIC_SLOTS_PER_BLOCK: usize = 64;
/// Words (u64) per statistics item: 5 f64 sums, 11 counters, 2 values at the largest error.
const STAT_WORDS: usize = 18;

/// Metrics launched on the device and copied (asynchronously) into a pinned slot; read with
/// [`Gpu::metrics_collect`], which waits only for this copy, not for work queued after it.
pub struct PendingMetrics {
    slot: usize,
    ev: CudaEvent,
    items: Vec<(usize, bool)>,
    _keep: Vec<DevRef>,
    _acc: Buf,
}

// The raw pinned pointers are owned by `Gpu` and only touched under its `&mut self`.
unsafe impl Send for Gpu {}

impl Drop for Gpu {
    fn drop(&mut self) {
        let _ = self.stream.synchronize();
        for (p, _, _) in self.pinned.drain(..).chain(self.pinned_spare.drain(..)) {
            unsafe {
                let _ = dres::free_host(p as _);
            }
        }
        for p in self.metric_blocks.drain(..) {
            unsafe {
                let _ = dres::free_host(p as _);
            }
        }
    }
}

pub(crate) const STAGE: usize = 256 << 20;
/// The pinned staging buffers of a device state whose large ones are lent to a loader.
const SMALL_STAGE: usize = 16 << 20;
/// Transfers from this size on go through the pinned staging buffers.
const STAGED_MIN: usize = 1 << 20;

impl Gpu {
    /// The kernels' module: the shipped CUBIN for this architecture when it matches the sources
    /// (no compile, no JIT), else the PTX NVRTC made on an earlier start, else NVRTC now. Returns
    /// the module, the architecture and where the code came from (for `describe`).
    fn load_kernels(
        ctx: &Arc<CudaContext>,
        maj: i32,
        min: i32,
    ) -> Result<(Arc<cudarc::driver::CudaModule>, String, &'static str)> {
        if std::env::var_os("NVFP4_PROBE_NVRTC").is_none() {
            if let Some(img) = image::shipped(maj, min) {
                if let Ok(m) = ctx.load_module(Ptx::from_binary(img.to_vec())) {
                    return Ok((m, format!("sm_{maj}{min}"), "shipped CUBIN"));
                }
            }
        }
        let arch = format!("compute_{maj}{min}");
        if let Some(text) = image::cached_ptx(&arch) {
            if let Ok(m) = ctx.load_module(Ptx::from_src(text)) {
                return Ok((m, arch, "cached PTX"));
            }
        }
        let ptx = String::from_utf8(image::compile(&arch)?)
            .map_err(|e| cuda_err("NVRTC PTX is not text", e))?;
        image::store_ptx(&arch, &ptx);
        let m = ctx
            .load_module(Ptx::from_src(ptx))
            .map_err(|e| cuda_err("load module", e))?;
        Ok((m, arch, "NVRTC"))
    }

    /// Open device 0, compile the kernels for its architecture, set up cuBLAS and staging.
    pub fn new() -> Result<Gpu> {
        let ctx = CudaContext::new(0).map_err(|e| cuda_err("no usable device", e))?;
        let (maj, min) = ctx
            .compute_capability()
            .map_err(|e| cuda_err("compute capability", e))?;
        let device_name = ctx.name().unwrap_or_else(|_| "unknown".into());
        let sm_count = ctx
            .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .unwrap_or(80) as u32;
        let t0 = Instant::now();
        let (module, arch, kernels_from) = Self::load_kernels(&ctx, maj, min)?;
        let mut funcs = HashMap::new();
        for &k in KERNELS {
            funcs.insert(
                k,
                module
                    .load_function(k)
                    .map_err(|e| cuda_err(&format!("kernel {k}"), e))?,
            );
        }
        let compile_seconds = t0.elapsed().as_secs_f64();
        unsafe { ctx.disable_event_tracking() };
        // Keep freed device memory in the stream-ordered allocator's pool: with the default
        // release threshold (0) the pool hands memory back to the driver at every
        // synchronization, and the next allocations map it again (milliseconds each for the
        // weight batches). Best effort: without it only speed changes.
        unsafe {
            let mut pool: dsys::CUmemoryPool = std::ptr::null_mut();
            if dsys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device())
                == dsys::CUresult::CUDA_SUCCESS
            {
                let mut keep: u64 = u64::MAX;
                let _ = dsys::cuMemPoolSetAttribute(
                    pool,
                    dsys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                    &mut keep as *mut u64 as *mut std::ffi::c_void,
                );
            }
        }
        let stream = ctx.new_stream().map_err(|e| cuda_err("stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| cuda_err("cuBLAS", e))?;
        // the large set, and the small one used while the large is lent to a run's loader:
        // pinning 2 × 16 MiB when the run lends them took 21 ms of the run on the H200
        let (mut pinned, mut pinned_spare) = (Vec::new(), Vec::new());
        for (set, bytes) in [(&mut pinned, STAGE), (&mut pinned_spare, SMALL_STAGE)] {
            for _ in 0..2 {
                let p =
                    unsafe { dres::malloc_host(bytes, 0) }.map_err(|e| cuda_err("pinned", e))?;
                let ev = ctx.new_event(None).map_err(|e| cuda_err("event", e))?;
                ev.record(&stream).map_err(|e| cuda_err("event", e))?;
                set.push((p as *mut u8, bytes, ev));
            }
        }
        let bounce = Arc::new(Bounce::new(&ctx)?);
        let mut g = Gpu {
            ctx,
            stream,
            blas,
            funcs,
            device_name,
            arch,
            compile_seconds,
            kernels_from,
            sm_count,
            weights: HashMap::new(),
            files: HashMap::new(),
            preloaded: HashMap::new(),
            scratch: HashMap::new(),
            pinned,
            pinned_spare,
            lent: false,
            counters: GpuCounters::default(),
            exact64: true,
            v2: std::env::var("NVFP4_PROBE_KERNELS")
                .ok()
                .as_deref()
                .map(str::trim)
                != Some("v1"),
            aq_kernel: std::env::var("NVFP4_PROBE_AQ_KERNEL")
                .ok()
                .and_then(|v| {
                    AQ_KERNELS
                        .iter()
                        .find(|(k, _)| *k == v.trim())
                        .map(|(k, _)| *k)
                })
                .unwrap_or(AQ_KERNEL_DEFAULT),
            grouped_experts: std::env::var("NVFP4_PROBE_EXPERTS")
                .ok()
                .as_deref()
                .map(str::trim)
                != Some("loop"),
            grouped_mx: !matches!(
                std::env::var("NVFP4_PROBE_EXPERTS")
                    .ok()
                    .as_deref()
                    .map(str::trim),
                Some("loop" | "loop-mx")
            ),
            bounce,
            ktimer: (std::env::var("NVFP4_PROBE_KERNEL_TIME").ok().as_deref() == Some("1"))
                .then(Default::default),
            stager: None,
            metric_blocks: Vec::new(),
            metric_free: Vec::new(),
            prepared: HashMap::new(),
            defer: false,
            deferred: Vec::new(),
            expert_chunk: experts::expert_chunk_from_env(),
        };
        // the first block of pinned metrics slots, now: pinning host memory during a run waits
        // for the driver behind the loader's work (9.5 ms at a Flash run's first op)
        g.add_metric_block()?;
        if let Ok(v) = std::env::var("NVFP4_PROBE_BLAS_WARMUP") {
            g.warm_blas(&v)?;
        }
        Ok(g)
    }

    /// Run GEMMs of the shapes `MxNxK[,…]` (f32 inputs, the exact-f64 path) once and wait:
    /// `NVFP4_PROBE_BLAS_WARMUP`, for measuring cuBLAS's first-call costs.
    fn warm_blas(&mut self, shapes: &str) -> Result<()> {
        for sh in shapes.split(',').filter(|x| !x.trim().is_empty()) {
            let d: Vec<usize> = sh
                .split('x')
                .filter_map(|v| v.trim().parse().ok())
                .collect();
            let [m, n, k] = d[..] else {
                return Err(Error::usage(format!(
                    "NVFP4_PROBE_BLAS_WARMUP: `{sh}` is not MxNxK"
                )));
            };
            let t0 = std::time::Instant::now();
            let x = self.alloc(m * k * 4)?;
            let w = self.alloc(n * k * 4)?;
            let y = self.alloc(m * n * 4)?;
            self.memset(x.ptr, 0, m * k * 4)?;
            self.memset(w.ptr, 0, n * k * 4)?;
            self.gemm(Ty::F32, x.ptr, k, w.ptr, y.ptr, n, m, n, k)?;
            self.sync()?;
            if crate::profile::enabled() {
                eprintln!(
                    "profile: BLAS warm-up {m}x{n}x{k}: {:.1} ms",
                    t0.elapsed().as_secs_f64() * 1e3
                );
            }
        }
        Ok(())
    }

    /// One line for reports: device, architecture, compile time.
    pub fn describe(&self) -> String {
        format!(
            "{} ({}, {} SMs; kernels from {} in {:.0} ms)",
            self.device_name,
            self.arch,
            self.sm_count,
            self.kernels_from,
            self.compile_seconds * 1e3
        )
    }

    // ---- memory ---------------------------------------------------------------------------

    pub fn alloc(&self, bytes: usize) -> Result<Buf> {
        let s = unsafe { self.stream.alloc::<u8>(bytes.max(16)) }
            .map_err(|e| cuda_err(&format!("alloc {bytes} B"), e))?;
        let ptr = {
            let (p, _g) = s.device_ptr(&self.stream);
            p
        };
        Ok(Buf {
            _s: std::sync::Arc::new(Mem::Own(s)),
            ptr,
            bytes,
        })
    }

    /// A grow-only scratch buffer by name.
    fn scratch(&mut self, name: &'static str, bytes: usize) -> Result<u64> {
        if self.scratch.get(name).is_none_or(|b| b.bytes < bytes) {
            self.scratch.remove(name);
            let b = self.alloc(bytes.next_power_of_two().max(1 << 16))?;
            self.scratch.insert(name, b);
        }
        Ok(self.scratch[name].ptr)
    }

    /// This device state's identity (`DeviceValues::owner` of what it made).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.stream) as *const u8 as usize
    }

    /// The device address of a tensor's values: its device copy, or the host values uploaded
    /// now and kept with the tensor, so the next op (or path) that reads it does not upload again.
    pub fn input(&self, x: &Data) -> Result<DevRef> {
        if let Some(d) = x.device() {
            if d.owner() == self.id() {
                return Ok(DevRef {
                    ptr: d.ptr(),
                    _keep: d.clone(),
                });
            }
        }
        let n = x.len();
        let b = self.upload(&x[..])?;
        let d: Arc<dyn crate::tensor::DeviceValues> = Arc::new(DevTensor {
            buf: b,
            n,
            stream: self.stream.clone(),
            bounce: self.bounce.clone(),
        });
        if x.device().is_none() {
            x.attach_device(d.clone());
        }
        Ok(DevRef {
            ptr: d.ptr(),
            _keep: d,
        })
    }

    /// Device values as a tensor's data, left on the device; `exact`: every value is known to be
    /// a BF16 value (the producer rounded).
    pub fn output(&self, b: Buf, n: usize, exact: bool) -> Data {
        debug_assert!(b.bytes >= n * 4);
        let d = Data::from_device(Arc::new(DevTensor {
            buf: b,
            n,
            stream: self.stream.clone(),
            bounce: self.bounce.clone(),
        }));
        if exact {
            d.set_bf16_exact(true);
        }
        d
    }

    /// A device copy of `x`'s values in a new allocation (for kernels that work in place).
    pub fn input_copy(&self, x: &Data) -> Result<Buf> {
        let n = x.len();
        let src = self.input(x)?;
        let b = self.alloc(n * 4)?;
        if n > 0 {
            unsafe { dres::memcpy_dtod_async(b.ptr, src.ptr, n * 4, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy on device", e))?;
        }
        Ok(b)
    }

    /// The BF16 storage rounding of `x` on the device (values that are not on the host stay there).
    pub fn round_data(&self, x: &mut Data) -> Result<()> {
        let n = x.len();
        let b = self.input_copy(x)?;
        self.launch(
            "round_bf16",
            n as u64,
            &[A::P(b.ptr), A::U(n as u64), A::P(0)],
        )?;
        *x = self.output(b, n, true);
        Ok(())
    }

    /// Whether every value of `x` is a BF16 value (NaN counts as one): known from its producer,
    /// scanned on the host when the values are there, else counted on the device.
    pub fn bf16_exact(&mut self, x: &Data) -> Result<bool> {
        if let Some(e) = x.known_bf16_exact() {
            return Ok(e);
        }
        if x.on_host() {
            return Ok(crate::numerics::bf16::all_exact(&x[..]));
        }
        let n = x.len();
        let p = self.input(x)?;
        let c = self.scratch("inexact_count", 8)?;
        self.memset(c, 0, 8)?;
        self.launch(
            "count_inexact_bf16",
            n as u64,
            &[A::P(p.ptr), A::U(n as u64), A::P(c)],
        )?;
        let v: Vec<u64> = self.download(c, 1)?;
        let exact = v[0] == 0;
        x.set_bf16_exact(exact);
        Ok(exact)
    }

    /// Pageable host → device (small tensors: activations, scalars).
    pub fn upload<T: Copy>(&self, src: &[T]) -> Result<Buf> {
        let b = self.alloc(std::mem::size_of_val(src))?;
        self.copy_in(b.ptr, src)?;
        Ok(b)
    }

    /// Host → device. From 1 MiB on through the pinned staging buffers (a parallel copy into
    /// pinned memory, then DMA), several times faster than the driver's pageable path.
    pub fn copy_in<T: Copy>(&self, dst: u64, src: &[T]) -> Result<()> {
        if src.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::size_of_val(src);
        if bytes >= STAGED_MIN && !self.pinned.is_empty() {
            // SAFETY: a byte view of initialised `Copy` data
            let b = unsafe { std::slice::from_raw_parts(src.as_ptr() as *const u8, bytes) };
            return self.stage_in(dst, b);
        }
        self.timed("copy host->device (small)", || {
            unsafe { dres::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy to device", e))
        })
    }

    /// Device → host; synchronizes the stream. From 1 MiB on through the pinned staging buffers,
    /// below that through the pinned bounce buffer (never into pageable memory: see [`Bounce`]).
    pub fn download<T: Copy + Default>(&self, src: u64, n: usize) -> Result<Vec<T>> {
        let mut v = vec![T::default(); n];
        let bytes = std::mem::size_of_val(&v[..]);
        if bytes >= STAGED_MIN && !self.pinned.is_empty() {
            // SAFETY: every bit pattern is written by the copy; the element types used here
            // (f32, u8, u16, u32, u64, i32) are valid for any bits
            let b = unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr() as *mut u8, bytes) };
            self.stage_out(b, src)?;
            return Ok(v);
        }
        if n == 0 {
            self.sync()?;
            return Ok(v);
        }
        // (not on the kernel timer: the read waits for the stream inside)
        self.bounce
            .read(&self.stream, src, &mut v)
            .map_err(Error::Backend)?;
        Ok(v)
    }

    /// Host bytes → device through the two pinned buffers: each chunk is copied in parallel into
    /// a pinned buffer once that buffer's previous DMA has finished, then sent asynchronously.
    fn stage_in(&self, dst: u64, src: &[u8]) -> Result<()> {
        use rayon::prelude::*;
        let stage = self.stage_len();
        for (ci, chunk) in src.chunks(stage).enumerate() {
            let (p, _, ev) = &self.pinned[ci % 2];
            {
                let _s = crate::profile::span("host: stage_in wait");
                ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            }
            let pin = unsafe { std::slice::from_raw_parts_mut(*p, chunk.len()) };
            let _s = crate::profile::span("host: stage_in memcpy");
            pin.par_chunks_mut(1 << 20)
                .zip(chunk.par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
            self.timed("copy host->device (staged)", || {
                unsafe {
                    dres::memcpy_htod_async(
                        dst + (ci * stage) as u64,
                        &pin[..],
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| cuda_err("copy to device", e))
            })?;
            ev.record(&self.stream).map_err(|e| cuda_err("event", e))?;
        }
        Ok(())
    }

    /// Device → host bytes through a pinned buffer (DMA, then a parallel copy out).
    fn stage_out(&self, dst: &mut [u8], src: u64) -> Result<()> {
        use rayon::prelude::*;
        let stage = self.stage_len();
        for (ci, chunk) in dst.chunks_mut(stage).enumerate() {
            let (p, _, ev) = &self.pinned[ci % 2];
            ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            let pin = unsafe { std::slice::from_raw_parts_mut(*p, chunk.len()) };
            self.timed("copy device->host", || {
                unsafe {
                    dres::memcpy_dtoh_async(
                        &mut pin[..],
                        src + (ci * stage) as u64,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(|e| cuda_err("copy to host", e))
            })?;
            {
                let _s = crate::profile::span("host: stage_out wait");
                self.sync()?;
            }
            let _s = crate::profile::span("host: stage_out memcpy");
            chunk
                .par_chunks_mut(1 << 20)
                .zip(pin.par_chunks(1 << 20))
                .for_each(|(d, s)| d.copy_from_slice(s));
        }
        Ok(())
    }

    /// Bytes of one pinned staging buffer in use.
    fn stage_len(&self) -> usize {
        self.pinned.first().map_or(STAGE, |p| p.1)
    }

    /// Lend the large pinned staging buffers (pointer, bytes) to a run's loader thread, which
    /// then has them to itself; this state stages through its small set meanwhile (allocated when
    /// it opened). Give them back with [`Gpu::unlend_pinned`] once the loader is done.
    pub fn lend_pinned(&mut self) -> Result<Vec<(usize, usize)>> {
        if self.lent {
            return Ok(Vec::new());
        }
        // nothing of this state may still be copying out of them
        for (_, _, ev) in &self.pinned {
            ev.synchronize().map_err(|e| cuda_err("staging", e))?;
        }
        std::mem::swap(&mut self.pinned, &mut self.pinned_spare);
        self.lent = true;
        Ok(self
            .pinned_spare
            .iter()
            .map(|(p, n, _)| (*p as usize, *n))
            .collect())
    }

    /// Take the lent buffers back (the loader has finished every copy out of them).
    pub fn unlend_pinned(&mut self) -> Result<()> {
        if self.lent {
            for (_, _, ev) in &self.pinned {
                ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            }
            std::mem::swap(&mut self.pinned, &mut self.pinned_spare);
            self.lent = false;
        }
        Ok(())
    }

    pub fn sync(&self) -> Result<()> {
        let _s = crate::profile::span("host: sync");
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("kernel execution", e))
    }

    pub fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        unsafe { dres::memset_d8_async(dst, byte, bytes, self.stream.cu_stream()) }
            .map_err(|e| cuda_err("memset", e))
    }

    /// Copy the first pinned staging buffer to `dst` (asynchronously; for the H2D bandwidth bench).
    pub fn copy_pinned_to(&self, dst: u64) -> Result<usize> {
        let (p, n, _) = &self.pinned[0];
        let src = unsafe { std::slice::from_raw_parts(*p as *const u8, *n) };
        self.timed("copy host->device", || {
            unsafe { dres::memcpy_htod_async(dst, src, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy to device", e))
        })?;
        Ok(*n)
    }

    /// Stream bytes from the mmap to the device through two pinned buffers: the copy of one chunk
    /// into pinned memory (parallel, which also faults the pages in from disk) overlaps the DMA of
    /// the previous chunk.
    pub fn upload_staged(&mut self, src: &[u8]) -> Result<Buf> {
        let t0 = Instant::now();
        let b = self.alloc(src.len())?;
        self.copy_in(b.ptr, src)?;
        self.counters.bytes_uploaded += src.len() as u64;
        self.counters.upload_seconds += t0.elapsed().as_secs_f64();
        Ok(b)
    }

    // ---- launches ---------------------------------------------------------------------------

    fn grid(&self, name: &str, n: u64) -> LaunchConfig {
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

    /// out[r] = x[rows[r]] for `nrows` rows of width `d` (`rows`: device i32 row indices).
    pub fn gather_rows(&self, x: u64, rows: u64, nrows: usize, d: usize, out: u64) -> Result<()> {
        self.launch(
            "gather_rows",
            (nrows * d) as u64,
            &[
                A::P(x),
                A::P(rows),
                A::U(nrows as u64),
                A::U(d as u64),
                A::P(out),
            ],
        )
    }

    /// Launch kernel `name` over `n` work items (grid-stride).
    pub fn launch(&self, name: &str, n: u64, args: &[A]) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        self.launch_cfg(name, self.grid(name, n), args)
    }

    /// Launch kernel `name` with an explicit grid, block and dynamic shared memory.
    pub fn launch_cfg(&self, name: &str, cfg: LaunchConfig, args: &[A]) -> Result<()> {
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

    /// Run `f` (work enqueued on the stream) between two timing events when the kernel timer is on.
    fn timed<R>(&self, name: &'static str, f: impl FnOnce() -> Result<R>) -> Result<R> {
        let Some(t) = &self.ktimer else {
            return f();
        };
        let ev = |t: &mut KernelTimer| match t.free.pop() {
            Some(e) => Ok(e),
            None => self
                .ctx
                .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| cuda_err("event", e)),
        };
        let (a, b) = {
            let mut t = t.borrow_mut();
            (ev(&mut t)?, ev(&mut t)?)
        };
        a.record(&self.stream).map_err(|e| cuda_err("event", e))?;
        let r = f();
        b.record(&self.stream).map_err(|e| cuda_err("event", e))?;
        let mut t = t.borrow_mut();
        t.pending.push((a, b, name, crate::profile::step()));
        if t.pending.len() >= 4096 {
            t.drain()?;
        }
        r
    }

    /// With the kernel timer on: device seconds (kernels, cuBLAS calls and copies on the compute
    /// stream) by op step, in step order.
    pub fn kernel_times_by_step(&self) -> Option<Vec<(usize, f64)>> {
        let t = self.ktimer.as_ref()?;
        let mut t = t.borrow_mut();
        t.drain().ok()?;
        let mut by_step: HashMap<usize, f64> = HashMap::new();
        for ((step, _), (_, ms)) in &t.by_step_kernel {
            *by_step.entry(*step).or_default() += ms / 1e3;
        }
        let mut v: Vec<_> = by_step.into_iter().collect();
        v.sort_by_key(|x| x.0);
        Some(v)
    }

    /// With the kernel timer on: the kernels of op `step` as (name, calls, device seconds),
    /// longest first.
    pub fn kernel_times_of_step(&self, step: usize) -> Vec<(&'static str, u64, f64)> {
        let Some(t) = self.ktimer.as_ref() else {
            return Vec::new();
        };
        let t = t.borrow();
        let mut v: Vec<_> = t
            .by_step_kernel
            .iter()
            .filter(|((s, _), _)| *s == step)
            .map(|((_, k), (n, ms))| (*k, *n, ms / 1e3))
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        v
    }

    /// With the kernel timer on: (name, calls, device seconds) per kernel, cuBLAS call and copy
    /// kind so far, longest first.
    pub fn kernel_times(&self) -> Option<Vec<(&'static str, u64, f64)>> {
        let t = self.ktimer.as_ref()?;
        let mut t = t.borrow_mut();
        t.drain().ok()?;
        let mut v: Vec<_> = t
            .by_kernel
            .iter()
            .map(|(k, (n, ms))| (*k, *n, ms / 1e3))
            .collect();
        v.sort_by(|a, b| b.2.total_cmp(&a.2));
        Some(v)
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
        let (name, n) = if self.v2 {
            // one work item per lane-step of DQ2_U pieces: 16-byte stores of 8 BF16 (2 per
            // block) or 4 f32 (4 per block)
            let pieces = nblocks * if d.out_bf16 { 2 } else { 4 };
            ("dequant_nvfp4_v2", pieces.div_ceil(DQ2_U))
        } else {
            ("dequant_nvfp4", nblocks * 4)
        };
        self.launch(
            name,
            n,
            &[
                A::P(packed),
                A::P(scales),
                A::U(nblocks),
                A::F(d.global),
                A::I(d.conv),
                A::F(d.post.unwrap_or(1.0)),
                A::I(d.post.is_some() as i32),
                A::I(d.swap as i32),
                A::I(d.out_bf16 as i32),
                A::P(out),
            ],
        )
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
        self.launch(
            name,
            n,
            &[
                A::P(x),
                A::U(nblocks),
                A::F(g),
                A::P(o.packed),
                A::P(o.scales),
                A::P(o.xq16),
                A::P(o.xhat),
                A::I(o.xhat_bf16 as i32),
                A::P(o.health),
            ],
        )
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
        self.launch_cfg(
            "act_quant_nvfp4_seg",
            cfg,
            &[
                A::P(x),
                A::P(sb.ptr),
                A::P(o.packed),
                A::P(o.scales),
                A::P(o.xq16),
                A::P(o.xhat),
                A::I(o.xhat_bf16 as i32),
            ],
        )
    }

    /// `moe_gemm_f64`: for every tile, y[rows, n] = x[rows, k] · decode(w)ᵀ accumulated in f64 and
    /// rounded once (then the tile's epilogue), x f32 or BF16 bits (`xbf`) with row stride `ldx`,
    /// y f32 with row stride `ldy`. Needs k % 16 == 0 (k % 32 for MXFP4) and 16-byte aligned rows.
    #[allow(clippy::too_many_arguments)]
    pub fn moe_gemm(
        &self,
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
        let es = if xbf { 2 } else { 4 };
        if !k.is_multiple_of(16) || !(ldx * es).is_multiple_of(16) || !x.is_multiple_of(16) {
            return Err(Error::Backend(format!(
                "cuda: moe_gemm_f64 needs k % 16 == 0 and 16-byte aligned rows (k {k}, ldx {ldx})"
            )));
        }
        if tiles.len() > 65_535 {
            return Err(Error::Backend(format!(
                "cuda: moe_gemm_f64: {} tiles, at most 65535",
                tiles.len()
            )));
        }
        let tb = self.upload(tiles)?;
        let cfg = LaunchConfig {
            grid_dim: (n.div_ceil(MOE_C).min(65_535) as u32, tiles.len() as u32, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch_cfg(
            "moe_gemm_f64",
            cfg,
            &[
                A::P(x),
                A::I(xbf as i32),
                A::U(ldx as u64),
                A::P(tb.ptr),
                A::U(n as u64),
                A::U(k as u64),
                A::P(y),
                A::U(ldy as u64),
            ],
        )
    }

    /// f32 or BF16-bits [rows, cols] with row stride `ld` → contiguous f64.
    fn widen(
        &self,
        src: u64,
        bf: i32,
        rows: usize,
        cols: usize,
        ld: usize,
        dst: u64,
    ) -> Result<()> {
        self.launch(
            "to_f64",
            (rows * cols) as u64,
            &[
                A::P(src),
                A::I(bf),
                A::U(rows as u64),
                A::U(cols as u64),
                A::U(ld as u64),
                A::P(dst),
            ],
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
        let bf = (ty == Ty::Bf16) as i32;
        if m <= 8 {
            // one warp per four output columns
            return self.launch(
                "gemm_small_f64",
                // one block of 8 warps (the grid's 256 threads) per four output columns
                (n.div_ceil(4) * 256) as u64,
                &[
                    A::P(x),
                    A::P(w),
                    A::I(bf),
                    A::U(m as u64),
                    A::U(n as u64),
                    A::U(k as u64),
                    A::U(ldx as u64),
                    A::P(y),
                    A::U(ldy as u64),
                ],
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
            let (alpha, beta) = (1.0f64, 0.0f64);
            self.timed("cuBLAS DGEMM", || unsafe {
                blas::gemm_ex(
                    *self.blas.handle(),
                    bsys::cublasOperation_t::CUBLAS_OP_T,
                    bsys::cublasOperation_t::CUBLAS_OP_N,
                    n as i32,
                    m as i32,
                    k as i32,
                    &alpha as *const f64 as *const _,
                    wd as *const _,
                    bsys::cudaDataType::CUDA_R_64F,
                    k as i32,
                    xd as *const _,
                    bsys::cudaDataType::CUDA_R_64F,
                    k as i32,
                    &beta as *const f64 as *const _,
                    yd as *mut _,
                    bsys::cudaDataType::CUDA_R_64F,
                    n as i32,
                    bsys::cublasComputeType_t::CUBLAS_COMPUTE_64F,
                    bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
                .map_err(|e| cuda_err(&format!("DGEMM {m}x{n}x{k}"), e))
            })?;
        }
        self.launch(
            "from_f64",
            (m * n) as u64,
            &[
                A::P(yd),
                A::U(m as u64),
                A::U(n as u64),
                A::U(ldy as u64),
                A::P(y),
            ],
        )
    }

    /// [`Gpu::gemm`] over `groups` blocks: x block g (m rows from row g·m) times weight rows
    /// g·n.. (n of them) into columns g·n.. of y.
    #[allow(clippy::too_many_arguments)]
    fn gemm_g(
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
        // column-major view: Yᵀ[n, m] = W[k, n]ᵀ · Xᵀ[k, m]
        let what = if ty == Ty::F32 {
            "cuBLAS GEMM f32"
        } else {
            "cuBLAS GEMM bf16"
        };
        self.timed(what, || unsafe {
            blas::gemm_ex(
                *self.blas.handle(),
                bsys::cublasOperation_t::CUBLAS_OP_T,
                bsys::cublasOperation_t::CUBLAS_OP_N,
                n as i32,
                m as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                dt,
                k as i32,
                x as *const _,
                dt,
                ldx as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                bsys::cudaDataType::CUDA_R_32F,
                ldy as i32,
                ct,
                bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
            .map_err(|e| cuda_err(&format!("GEMM {m}x{n}x{k} {ty:?}"), e))
        })
    }

    // ---- weights ------------------------------------------------------------------------------

    /// Drop the weights of the finished op (device memory stays bounded by one op's weights).
    pub fn clear_weights(&mut self) {
        self.weights.clear();
        self.preloaded.clear();
        self.prepared.clear();
    }

    /// Serve an NVFP4 weight from its resident bytes (uploaded now if absent) with `scales` as its
    /// block-scale bytes (linear [n, k/16]; None: the stored ones, ignoring the loader's layout
    /// faults) and this nibble order, the scalars resolved from `lc` (faults and hypotheses). Stays
    /// until [`Gpu::forget_served`] or [`Gpu::clear_weights`], whatever later contexts say: bisect's
    /// replay uses it for repairs no `Override` expresses (block scales re-read from the checkpoint).
    pub fn pin_nvfp4_served(
        &mut self,
        lc: &LinearCtx,
        base: &str,
        scales: Option<&[u8]>,
        swap: bool,
    ) -> Result<()> {
        // only the bytes are needed: the served reading is replaced below, so a resident weight
        // is not re-read under `lc` (that recomputed each repair's rearranged block scales once
        // more, one weight at a time, after the caller had prepared them in parallel)
        if !self.weights.contains_key(base) {
            self.ensure_weight(lc, base)?;
        }
        let (n, k) = {
            let w = &self.weights[base];
            (w.n, w.k)
        };
        let m = lc.ckpt.weight_meta(base)?;
        let Some(conv) = m
            .convention
            .filter(|_| matches!(self.weights[base].fmt, DevFmt::Nv { .. }))
        else {
            return Err(Error::usage(format!(
                "internal: {base} is not an NVFP4 weight (block scales pinned)"
            )));
        };
        let faults = crate::served::faults::hitting(lc.faults, base);
        let overrides = served::overrides_of(lc.overrides, base);
        let p = served::nvfp4_params_of(lc.ckpt, &m, conv, lc.fuse_pairs, &faults, &overrides);
        let scales = match scales {
            Some(sc) => Some((
                self.upload_scales(sc, base, &m.file, n, k)?,
                String::from("pinned"),
            )),
            None => None,
        };
        let w = self.weights.get_mut(base).expect("ensured above");
        w.served = ServedDev::Native {
            nv: Some(p),
            swap,
            non_pow2: false,
            double_scale: false,
            scales,
        };
        w.served_key = None;
        Ok(())
    }

    /// Upload NVFP4 block-scale bytes for a served reading (at least [n, k/16]).
    fn upload_scales(
        &mut self,
        sc: &[u8],
        base: &str,
        file: &std::path::Path,
        n: usize,
        k: usize,
    ) -> Result<Buf> {
        if sc.len() < n * (k / 16) {
            return Err(Error::bad(
                file,
                Some(base),
                format!(
                    "block scale has {} bytes, expected {} for [{n}, {k}]",
                    sc.len(),
                    n * (k / 16)
                ),
            ));
        }
        self.upload(sc)
    }

    /// Undo [`Gpu::pin_nvfp4_served`]: the next use recomputes the served reading from its context
    /// (the bytes stay resident).
    pub fn forget_served(&mut self, base: &str) {
        if let Some(w) = self.weights.get_mut(base) {
            w.served_key = Some(String::from("\u{0}stale"));
        }
    }

    fn ensure_weight(&mut self, lc: &LinearCtx, base: &str) -> Result<()> {
        let _s = crate::profile::span("host: ensure_weight");
        let key = {
            let _s = crate::profile::span("host: ensure_weight served_key");
            served_key(lc, base)
        };
        if let Some(w) = self.weights.get(base) {
            if w.served_key.as_ref().is_none_or(|k| *k == key) {
                return Ok(());
            }
            // the bytes stay; only the served reading follows the new faults/hypotheses
            let lay = {
                let _s = crate::profile::span("host: ensure_weight layout");
                lc.ckpt.weight_layout(base)?
            };
            let _s = crate::profile::span("host: ensure_weight re-read served");
            let served = self.served_reading(lc, base, &lay)?;
            let w = self.weights.get_mut(base).expect("present above");
            w.served = served;
            w.served_key = Some(key);
            return Ok(());
        }
        let lay = lc.ckpt.weight_layout(base)?;
        let m = &lay.meta;
        let (n, k) = (m.out_features, m.in_features);
        let loc = m.file.clone();
        let bad = |what: &str, got: usize, want: usize| {
            Error::bad(
                &loc,
                Some(base),
                format!("{what} has {got} bytes/elements, expected {want} for [{n}, {k}]"),
            )
        };
        let span = |name: &str| lc.ckpt.canonical_span(name);
        let scale_name = || {
            lay.scale.clone().ok_or_else(|| {
                Error::bad(
                    &loc,
                    Some(base),
                    "quantized weight without a block-scale tensor",
                )
            })
        };
        use crate::checkpoint::{Dtype, Fp8ScaleKind, Scheme};
        let fmt = match m.scheme {
            Scheme::Dense => {
                let es = match m.weight_dtype {
                    Dtype::BF16 | Dtype::F16 => 2,
                    Dtype::F32 => 4,
                    _ => 0,
                };
                if es == 0 {
                    let v = lc.ckpt.tensor_f32(&lay.weight)?.data;
                    if v.len() != n * k {
                        return Err(bad("weight", v.len(), n * k));
                    }
                    DevFmt::Dense(self.upload(&v)?)
                } else {
                    let sp = span(&lay.weight)?;
                    if sp.len() != n * k * es {
                        return Err(bad("weight", sp.len() / es, n * k));
                    }
                    let raw = self.upload_span(lc.ckpt, &sp)?;
                    if es == 4 {
                        DevFmt::Dense(raw)
                    } else {
                        let f = self.alloc(n * k * 4)?;
                        let fmt = if m.weight_dtype == Dtype::BF16 { 3 } else { 4 };
                        self.launch(
                            "decode_bytes",
                            (n * k) as u64,
                            &[A::P(raw.ptr), A::U((n * k) as u64), A::I(fmt), A::P(f.ptr)],
                        )?;
                        DevFmt::Dense(f)
                    }
                }
            }
            Scheme::Fp8Block => {
                let block = m.block.unwrap_or([128, 128]);
                let sc = scale_name()?;
                let scales: Vec<f32> = match m.fp8_scale_kind.unwrap_or(Fp8ScaleKind::F32) {
                    Fp8ScaleKind::Ue8m0 => lc
                        .ckpt
                        .canonical_bytes(&sc)?
                        .iter()
                        .map(|&b| crate::numerics::ue8m0::decode(b))
                        .collect(),
                    Fp8ScaleKind::F32 => lc.ckpt.tensor_f32(&sc)?.data.into_vec(),
                };
                let ns = n.div_ceil(block[0].max(1)) * k.div_ceil(block[1].max(1));
                let sp = span(&lay.weight)?;
                if sp.len() != n * k {
                    return Err(bad("weight", sp.len(), n * k));
                }
                if scales.len() != ns || block[0] == 0 || block[1] == 0 {
                    return Err(bad("block scale", scales.len(), ns));
                }
                DevFmt::Fp8 {
                    bytes: self.upload_span(lc.ckpt, &sp)?,
                    scales: self.upload(&scales)?,
                    bm: block[0],
                    bn: block[1],
                }
            }
            Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt => {
                let bl = if m.convention.is_some() { 16 } else { 32 };
                let (wp, sp) = (span(&lay.weight)?, span(&scale_name()?)?);
                if k % bl != 0 || wp.len() != n * k / 2 {
                    return Err(bad("packed weight", wp.len(), n * k / 2));
                }
                if sp.len() != n * k / bl {
                    return Err(bad("block scale", sp.len(), n * k / bl));
                }
                let packed = self.upload_span(lc.ckpt, &wp)?;
                let scales = self.upload_span(lc.ckpt, &sp)?;
                match m.convention {
                    Some(conv) => DevFmt::Nv {
                        packed,
                        scales,
                        conv,
                        global: m.weight_global.unwrap_or(f32::NAN),
                    },
                    None => DevFmt::Mx { packed, scales },
                }
            }
        };
        let served = self.served_reading(lc, base, &lay)?;
        self.weights.insert(
            base.to_string(),
            DevWeight {
                n,
                k,
                fmt,
                served,
                served_key: Some(key),
            },
        );
        Ok(())
    }

    /// How the served path reads a weight whose bytes are (or are being made) resident: NVFP4
    /// scalars as the loader resolves them with the faults and hypotheses of `lc`, the nibble
    /// order, and for NVFP4 layout faults/repairs the rearranged block-scale bytes (computed on
    /// the host from the scale tensor alone). Only non-NVFP4 weights with layout faults are
    /// prepared on the host in full.
    fn served_reading(
        &mut self,
        lc: &LinearCtx,
        base: &str,
        lay: &crate::checkpoint::WeightLayout,
    ) -> Result<ServedDev> {
        let m = &lay.meta;
        let (n, k) = (m.out_features, m.in_features);
        use crate::checkpoint::Scheme;
        let sp = crate::profile::span("host: served_reading filter");
        let faults = crate::served::faults::hitting(lc.faults, base);
        let overrides = served::overrides_of(lc.overrides, base);
        drop(sp);
        use crate::served::faults::FaultKind as K;
        let has = |k: K| faults.iter().any(|f| f.kind == k);
        let nvfp4 = matches!(
            m.scheme,
            Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt
        ) && m.convention.is_some();
        if let (true, Some(conv)) = (nvfp4, m.convention) {
            // every NVFP4 layout fault and repair rearranges the scale bytes or the nibble order:
            // the device decodes the resident packed bytes with the rearranged scales. They
            // depend on the layout faults and repairs only: a scalar hypothesis on a weight with
            // a layout fault keeps the bytes it has.
            let lkey = layout_key(&faults, &overrides);
            let reuse = match self.weights.get_mut(base).map(|w| &mut w.served) {
                Some(ServedDev::Native {
                    scales: sc @ Some(_),
                    ..
                }) if sc.as_ref().is_some_and(|(_, k)| *k == lkey) => sc.take(),
                _ => None,
            };
            if let Some(reused) = reuse {
                let _s = crate::profile::span("host: served_reading params (scales reused)");
                let p =
                    served::nvfp4_params_of(lc.ckpt, m, conv, lc.fuse_pairs, &faults, &overrides);
                return Ok(ServedDev::Native {
                    nv: Some(p),
                    swap: has(K::NibbleSwap) ^ overrides.contains(&Override::NibbleSwap),
                    non_pow2: has(K::NonPow2Ue8m0),
                    double_scale: false,
                    scales: Some(reused),
                });
            }
            let _s = crate::profile::span("host: served_reading served bytes");
            let prepared = self.prepared.remove(base);
            let (sc, swap, p) = if let Some(r) = prepared {
                r
            } else {
                served::nvfp4_served_bytes(
                    lc.ckpt,
                    m,
                    conv,
                    lc.fuse_pairs,
                    &faults,
                    &overrides,
                    || {
                        let name = lay.scale.as_deref().ok_or_else(|| {
                            Error::bad(
                                &m.file,
                                Some(base),
                                "quantized weight without a block-scale tensor",
                            )
                        })?;
                        let _s = crate::profile::span("host: served_reading stored scale bytes");
                        Ok(lc.ckpt.canonical_bytes(name)?.to_vec())
                    },
                )?
            };
            let scales = match sc {
                Some(sc) => {
                    let _s = crate::profile::span("host: served_reading upload rearranged scales");
                    Some((self.upload_scales(&sc, base, &m.file, n, k)?, lkey))
                }
                None => None,
            };
            return Ok(ServedDev::Native {
                nv: Some(p),
                swap,
                non_pow2: has(K::NonPow2Ue8m0),
                double_scale: false,
                scales,
            });
        }
        // faults and hypotheses the device applies itself; the rest re-read the bytes on the host
        let native = faults.iter().all(|f| {
            !matches!(
                f.kind,
                K::SwizzledScales | K::ShiftedScaleRows | K::NanBlockScale
            )
        }) && overrides
            .iter()
            .all(|o| !matches!(o, Override::Unswizzle | Override::UnshiftRows));
        let served = if native {
            ServedDev::Native {
                nv: None,
                swap: has(K::NibbleSwap) ^ overrides.contains(&Override::NibbleSwap),
                non_pow2: has(K::NonPow2Ue8m0),
                double_scale: has(K::DoubleScale) && m.scheme == Scheme::Fp8Block,
                scales: None,
            }
        } else {
            // FP8 / MXFP4 layout faults (rare): the CPU reference prepares the weight
            let qw = lc.ckpt.weight(base)?;
            let f32w = qw.dequantize()?.data;
            let sw = served::prepare(lc.ckpt, &qw, &f32w, lc.fuse_pairs, &faults, &overrides)?;
            match sw {
                ServedWeight::Dense { w } => ServedDev::Host {
                    w: self.upload(&w)?,
                    nv: None,
                    fp8_act: false,
                    non_pow2: false,
                    dense: true,
                },
                ServedWeight::Fp8Act { w, non_pow2_act } => ServedDev::Host {
                    w: self.upload(&w)?,
                    nv: None,
                    fp8_act: true,
                    non_pow2: non_pow2_act,
                    dense: false,
                },
                ServedWeight::Nvfp4 { wq, p } => ServedDev::Host {
                    w: self.upload(&wq)?,
                    nv: Some(p),
                    fp8_act: false,
                    non_pow2: false,
                    dense: false,
                },
            }
        };
        Ok(served)
    }

    /// The stored tensors `ensure_weight` uploads for a weight, as (file, offset, length): the
    /// data of a BF16/F16/F32 dense weight, the bytes of an FP8 block weight (its scales are read
    /// on the host), the codes and block scales of an NVFP4/MXFP4 weight. Empty for a name that
    /// is not a weight, or a tensor in memory.
    pub fn staged_spans(ckpt: &Checkpoint, base: &str) -> Vec<(std::path::PathBuf, u64, usize)> {
        use crate::checkpoint::{Dtype, Scheme, Span};
        let Ok(l) = ckpt.weight_layout(base) else {
            return Vec::new();
        };
        let names: Vec<&String> = match l.meta.scheme {
            Scheme::Dense => match l.meta.weight_dtype {
                Dtype::BF16 | Dtype::F16 | Dtype::F32 => vec![&l.weight],
                _ => Vec::new(),
            },
            Scheme::Fp8Block => vec![&l.weight],
            Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt => {
                std::iter::once(&l.weight).chain(l.scale.as_ref()).collect()
            }
        };
        names
            .into_iter()
            .filter_map(|n| match ckpt.canonical_span(n) {
                Ok(Span::File { path, offset, len }) => Some((path.to_path_buf(), offset, len)),
                _ => None,
            })
            .collect()
    }

    /// The loader's device copy of a stored tensor, if it staged it (the compute stream then
    /// waits for that copy); `None`: read it here (the loader will not).
    fn take_staged(&mut self, key: &(std::path::PathBuf, u64)) -> Result<Option<Buf>> {
        let Some(st) = &self.stager else {
            return Ok(None);
        };
        let b = st.take(key)?;
        if let Some(b) = &b {
            self.counters.bytes_uploaded += b.bytes as u64;
        }
        Ok(b)
    }

    /// Read the stored tensors of many weights in batches: all their file ranges are read in
    /// parallel into pinned memory (one 256 MiB batch while the previous one is in flight), then
    /// copied to the device; `ensure_weight` then finds them in `preloaded`.
    pub fn preload(&mut self, ckpt: &Checkpoint, bases: &[&str]) -> Result<()> {
        use rayon::prelude::*;
        use std::os::unix::fs::FileExt;
        let t0 = Instant::now();
        let mut spans: Vec<(std::path::PathBuf, u64, usize)> = Vec::new();
        for b in bases {
            if self.weights.contains_key(*b) {
                continue;
            }
            // (a weight that does not resolve has no spans: ensure_weight reports it)
            for (path, offset, len) in Self::staged_spans(ckpt, b) {
                let key = (path, offset);
                if len <= self.stage_len() && !self.preloaded.contains_key(&key) {
                    if let Some(b) = self.take_staged(&key)? {
                        self.preloaded.insert(key, b);
                        continue;
                    }
                    spans.push((key.0, offset, len));
                }
            }
        }
        for (p, _, _) in &spans {
            if !self.files.contains_key(p) {
                let f = std::fs::File::open(p)
                    .map_err(|e| Error::bad(p, None, format!("cannot open shard: {e}")))?;
                self.files.insert(p.clone(), f);
            }
        }
        let mut i = 0;
        let mut ci = 0usize;
        while i < spans.len() {
            let mut j = i;
            let mut tot = 0usize;
            while j < spans.len() && tot + spans[j].2 <= self.stage_len() {
                tot += spans[j].2;
                j += 1;
            }
            let batch = &spans[i..j];
            let (p, _, ev) = &self.pinned[ci % 2];
            {
                let _s = crate::profile::span("host: preload wait");
                ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            }
            let base = *p as usize;
            let _s = crate::profile::span("host: preload read");
            // pieces of at most 4 MiB: (span index, offset in file, offset in pinned, length)
            let mut pieces = Vec::new();
            let mut at = 0usize;
            for (si, (_, off, len)) in batch.iter().enumerate() {
                let mut d = 0;
                while d < *len {
                    let n = (4 << 20).min(len - d);
                    pieces.push((si, off + d as u64, at + d, n));
                    d += n;
                }
                at += len;
            }
            let files = &self.files;
            pieces.par_iter().try_for_each(|&(si, foff, poff, n)| {
                // disjoint ranges of the pinned buffer
                let dst = unsafe { std::slice::from_raw_parts_mut((base + poff) as *mut u8, n) };
                files[&batch[si].0].read_exact_at(dst, foff).map_err(|e| {
                    Error::bad(
                        &batch[si].0,
                        None,
                        format!("read of bytes {foff}..{} failed: {e}", foff + n as u64),
                    )
                })
            })?;
            drop(_s);
            // the whole batch in one DMA into one allocation, which its tensors then share
            // (thousands of per-tensor copies ran at half the bus's rate)
            let arena = self.alloc(tot)?;
            let src = unsafe { std::slice::from_raw_parts(base as *const u8, tot) };
            self.timed("copy host->device (weights, batched)", || {
                unsafe { dres::memcpy_htod_async(arena.ptr, src, self.stream.cu_stream()) }
                    .map_err(|e| cuda_err("copy to device", e))
            })?;
            let mut at = 0usize;
            for (path, off, len) in batch {
                ckpt.note_read(*len);
                self.counters.bytes_uploaded += *len as u64;
                let piece = Buf {
                    _s: arena._s.clone(),
                    ptr: arena.ptr + at as u64,
                    bytes: *len,
                };
                self.preloaded.insert((path.clone(), *off), piece);
                at += len;
            }
            self.pinned[ci % 2]
                .2
                .record(&self.stream)
                .map_err(|e| cuda_err("event", e))?;
            ci += 1;
            i = j;
        }
        self.counters.upload_seconds += t0.elapsed().as_secs_f64();
        Ok(())
    }

    /// Read a tensor's bytes onto the device: file ranges with parallel positioned reads into
    /// pinned memory (overlapping the previous chunk's DMA), in-memory shards by copy.
    fn upload_span(&mut self, ckpt: &Checkpoint, sp: &crate::checkpoint::Span) -> Result<Buf> {
        use crate::checkpoint::Span;
        let _s = crate::profile::span("host: upload_span");
        let (path, offset, len) = match sp {
            Span::Mem(b) => {
                ckpt.note_read(b.len());
                return self.upload_staged(b);
            }
            Span::File { path, offset, len } => (*path, *offset, *len),
        };
        if let Some(b) = self.preloaded.remove(&(path.to_path_buf(), offset)) {
            return Ok(b);
        }
        if let Some(b) = self.take_staged(&(path.to_path_buf(), offset))? {
            return Ok(b);
        }
        let t0 = Instant::now();
        ckpt.note_read(len);
        if !self.files.contains_key(path) {
            let f = std::fs::File::open(path)
                .map_err(|e| Error::bad(path, None, format!("cannot open shard: {e}")))?;
            self.files.insert(path.to_path_buf(), f);
        }
        let file = &self.files[path];
        let b = self.alloc(len)?;
        let mut done = 0usize;
        let mut ci = 0usize;
        while done < len {
            let n = self.stage_len().min(len - done);
            let (p, _, ev) = &self.pinned[ci % 2];
            ev.synchronize().map_err(|e| cuda_err("staging", e))?;
            let dst = unsafe { std::slice::from_raw_parts_mut(*p, n) };
            use rayon::prelude::*;
            use std::os::unix::fs::FileExt;
            let base_off = offset + done as u64;
            dst.par_chunks_mut(4 << 20)
                .enumerate()
                .try_for_each(|(i, d)| file.read_exact_at(d, base_off + (i * (4 << 20)) as u64))
                .map_err(|e| {
                    Error::bad(
                        path,
                        None,
                        format!(
                            "read of bytes {base_off}..{} failed: {e}",
                            base_off + n as u64
                        ),
                    )
                })?;
            self.timed("copy host->device (weights)", || {
                unsafe {
                    dres::memcpy_htod_async(b.ptr + done as u64, &dst[..], self.stream.cu_stream())
                }
                .map_err(|e| cuda_err("copy to device", e))
            })?;
            ev.record(&self.stream).map_err(|e| cuda_err("event", e))?;
            done += n;
            ci += 1;
        }
        self.counters.bytes_uploaded += len as u64;
        self.counters.upload_seconds += t0.elapsed().as_secs_f64();
        Ok(b)
    }

    /// Dequantize the stored weight into `out` (`Ty::F32` values or BF16 bits).
    /// `conv_override`: for NVFP4, 2 = e2m1·s without the tensor scale (the served operand).
    /// `round`: round f32 output to BF16 values. `post`: a multiplier applied after decoding.
    fn dequant(
        &self,
        w: &DevWeight,
        out: u64,
        out_ty: Ty,
        served_operand: bool,
        round: bool,
        post: Option<f32>,
    ) -> Result<()> {
        let ok = if out_ty == Ty::Bf16 { 1 } else { 0 };
        let nk = (w.n * w.k) as u64;
        // (nibble swap, double-applied FP8 scale, NVFP4 block scales other than the stored ones):
        // the served reading's loader faults and repairs
        let flags = match &w.served {
            ServedDev::Native {
                swap,
                double_scale,
                scales,
                ..
            } => (*swap, *double_scale, scales.as_ref().map(|(b, _)| b.ptr)),
            ServedDev::Host { .. } => (false, false, None),
        };
        match &w.fmt {
            DevFmt::Dense(b) => self.launch(
                "convert_dense",
                nk,
                &[
                    A::P(b.ptr),
                    A::U(nk),
                    A::I(round as i32),
                    A::I(ok),
                    A::P(out),
                ],
            )?,
            DevFmt::Fp8 {
                bytes,
                scales,
                bm,
                bn,
            } => self.launch(
                "dequant_fp8_block",
                nk,
                &[
                    A::P(bytes.ptr),
                    A::P(scales.ptr),
                    A::U(w.n as u64),
                    A::U(w.k as u64),
                    A::U(*bm as u64),
                    A::U(*bn as u64),
                    A::I((served_operand && flags.1) as i32),
                    A::I(ok),
                    A::P(out),
                ],
            )?,
            DevFmt::Mx { packed, scales } => self.launch(
                "dequant_mxfp4",
                nk / 32,
                &[
                    A::P(packed.ptr),
                    A::P(scales.ptr),
                    A::U(nk / 32),
                    A::I(ok),
                    A::P(out),
                ],
            )?,
            DevFmt::Nv {
                packed,
                scales,
                conv,
                global,
            } => {
                let c = if served_operand {
                    2
                } else {
                    match conv {
                        Convention::CompressedTensors => 0,
                        Convention::ModelOpt => 1,
                    }
                };
                let sp = match flags.2 {
                    Some(p) if served_operand => p,
                    _ => scales.ptr,
                };
                self.dequant_nvfp4(
                    packed.ptr,
                    sp,
                    nk / 16,
                    Nvfp4Decode {
                        global: *global,
                        conv: c,
                        post,
                        swap: served_operand && flags.0,
                        out_bf16: ok == 1,
                    },
                    out,
                )?
            }
        }
        // BF16 bits are already rounded; f32 output is rounded here when asked
        if round && out_ty == Ty::F32 && !matches!(w.fmt, DevFmt::Dense(_)) {
            self.launch("round_bf16", nk, &[A::P(out), A::U(nk), A::P(0)])?;
        }
        Ok(())
    }

    /// f32 → BF16 bits into a scratch buffer.
    fn bf16_copy(&mut self, name: &'static str, x: u64, n: usize) -> Result<u64> {
        let p = self.scratch(name, n * 2)?;
        self.launch("round_bf16", n as u64, &[A::P(x), A::U(n as u64), A::P(p)])?;
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
    fn linear_dev(
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
    fn linear_with(
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
    fn epilogue(&self, y: u64, m: usize, n: usize, ldy: usize, mul: f32) -> Result<()> {
        if ldy == n {
            self.launch(
                "scale_round",
                (m * n) as u64,
                &[A::P(y), A::U((m * n) as u64), A::F(mul), A::I(1)],
            )
        } else {
            for r in 0..m {
                self.launch(
                    "scale_round",
                    n as u64,
                    &[
                        A::P(y + (r * ldy * 4) as u64),
                        A::U(n as u64),
                        A::F(mul),
                        A::I(1),
                    ],
                )?;
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
                matches!(w.fmt, DevFmt::Fp8 { .. } | DevFmt::Mx { .. }),
                *non_pow2,
                matches!(w.fmt, DevFmt::Dense(_)),
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
            let xq = self.scratch("xq32", m * groups * k * 4)?;
            self.launch(
                "act_quant_fp8",
                (m * groups * k.div_ceil(128)) as u64,
                &[
                    A::P(x),
                    A::U((m * groups) as u64),
                    A::U(k as u64),
                    A::I(non_pow2 as i32),
                    A::P(xq),
                ],
            )?;
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
                    unsafe { dres::memcpy_dtod_async(tmp, hp, nk * 4, self.stream.cu_stream()) }
                        .map_err(|e| cuda_err("copy", e))?;
                    self.launch(
                        "scale_round",
                        nk as u64,
                        &[A::P(tmp), A::U(nk as u64), A::F(d), A::I(1)],
                    )?;
                    self.launch(
                        "round_bf16",
                        nk as u64,
                        &[A::P(tmp), A::U(nk as u64), A::P(wq16)],
                    )?;
                } else {
                    self.launch(
                        "round_bf16",
                        nk as u64,
                        &[A::P(hp), A::U(nk as u64), A::P(wq16)],
                    )?;
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
                    let wp = self.scratch("w32", nk * 4)?;
                    self.dequant(w, wp, Ty::F32, true, false, None)?;
                    self.gemm_g(Ty::F32, x, k, off(wp, 4), y, ldy, m, nr, k, groups)?;
                }
                self.epilogue(y, m, nr * groups, ldy, mul)?;
            }
        }
        Ok(Some(p))
    }

    /// Observation of one served NVFP4 linear from its device counters.
    fn observation(p: Option<Nvfp4Params>, h: &[u64], profile: Profile) -> LinearObs {
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

    /// How the grouped experts op computes linear `j` (0 w1, 1 w3, 2 w2) of every routed expert
    /// on this path: the activation operand (one kind for all experts) and per expert the tile
    /// template and the served NVFP4 parameters. None when some weight needs the per-expert
    /// sequence (a format other than NVFP4/MXFP4, a served reading prepared on the host, NVFP4
    /// served without parameters, experts of different shapes or activation kinds).
    #[allow(clippy::type_complexity)]
    fn moe_plan(
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
                    // dequant_mxfp4 of the served operand (no nibble-order flag), FP8 1x128
                    // activations, bf16(y) epilogue
                    return Some((
                        MoeAct::Fp8 {
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
    fn moe_act(
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
            MoeAct::Fp8 { non_pow2 } => {
                let xq = self.scratch("xq32", n * 4)?;
                self.launch(
                    "act_quant_fp8",
                    (total * k.div_ceil(128)) as u64,
                    &[
                        A::P(x),
                        A::U(total as u64),
                        A::U(k as u64),
                        A::I(non_pow2 as i32),
                        A::P(xq),
                    ],
                )?;
                (xq, false)
            }
        })
    }

    /// The store of an expert's gate and up projections (BF16 rounding when `round`), then SwiGLU
    /// with the clamp and its store, over `n` elements.
    fn swiglu_store(
        &self,
        gt: u64,
        up: u64,
        act: u64,
        n: usize,
        limit: f32,
        round: bool,
    ) -> Result<()> {
        if round {
            let m = n as u64;
            self.launch("round_bf16", m, &[A::P(gt), A::U(m), A::P(0)])?;
            self.launch("round_bf16", m, &[A::P(up), A::U(m), A::P(0)])?;
        }
        self.swiglu_clamp(gt, up, n, limit, round, act)
    }

    /// act = silu(min(gt, L)) · clamp(up, ±L) over `n` elements, rounded to BF16 when `round`.
    pub(crate) fn swiglu_clamp(
        &self,
        gt: u64,
        up: u64,
        n: usize,
        limit: f32,
        round: bool,
        act: u64,
    ) -> Result<()> {
        self.launch(
            "swiglu_clamp",
            n as u64,
            &[
                A::P(gt),
                A::P(up),
                A::U(n as u64),
                A::F(limit),
                A::I(round as i32),
                A::P(act),
            ],
        )
    }

    /// For the weights among `bases` whose served reading will rearrange NVFP4 block scales
    /// (layout faults or repairs under `lc`, not already resident in that layout), compute the
    /// rearranged bytes in parallel now (`served::nvfp4_served_bytes`, the same call
    /// `served_reading` makes one weight at a time). Failures are left to that sequential path,
    /// which reports them.
    fn prepare_layouts(&mut self, lc: &LinearCtx, bases: &[&str]) {
        use crate::checkpoint::Scheme;
        use rayon::prelude::*;
        let _s = crate::profile::span("host: prepare layouts");
        self.prepared.clear();
        let mut todo: Vec<(&str, Vec<&Fault>, Vec<Override>)> = Vec::new();
        for &b in bases {
            let key = served_key(lc, b);
            let w = self.weights.get(b);
            if w.is_some_and(|w| w.served_key.as_ref().is_none_or(|k| *k == key)) {
                continue; // ensure_weight keeps what it has
            }
            let faults = crate::served::faults::hitting(lc.faults, b);
            let ovs = served::overrides_of(lc.overrides, b);
            if !served::nvfp4_layout_changed(&faults, &ovs) {
                continue;
            }
            let lkey = layout_key(&faults, &ovs);
            if matches!(w.map(|w| &w.served), Some(ServedDev::Native { scales: Some((_, k)), .. }) if *k == lkey)
            {
                continue; // reused as it is
            }
            todo.push((b, faults, ovs));
        }
        if todo.len() < 2 {
            return;
        }
        let done: Vec<(String, PreparedLayout)> = todo
            .par_iter()
            .filter_map(|(b, faults, ovs)| {
                let lay = lc.ckpt.weight_layout(b).ok()?;
                let m = &lay.meta;
                let nvfp4 = matches!(
                    m.scheme,
                    Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt
                );
                let conv = m.convention.filter(|_| nvfp4)?;
                let scale = lay.scale.as_deref()?;
                served::nvfp4_served_bytes(lc.ckpt, m, conv, lc.fuse_pairs, faults, ovs, || {
                    Ok(lc.ckpt.canonical_bytes(scale)?.to_vec())
                })
                .ok()
                .map(|r| (b.to_string(), r))
            })
            .collect();
        self.prepared.extend(done);
    }

    // ---- statistics -----------------------------------------------------------------------------

    /// Statistics of `x` and, with a reference, the comparison, in one pass on the device.
    pub fn stats_compare(
        &mut self,
        x: u64,
        r: Option<u64>,
        n: usize,
    ) -> Result<(Stats, Option<Compare>)> {
        let acc = self.stats_queue(&[(x, r, n)])?;
        let raw: Vec<u64> = self.download(acc.ptr, STAT_WORDS)?;
        Ok(Self::stats_parse(&[(n, r.is_some())], &raw).remove(0))
    }

    /// Queue, per (x, reference, n), `fused_stats` into its own accumulator words of a new
    /// allocation and, with a reference, `stats_pick` (the two values at the largest error):
    /// [`STAT_WORDS`] words per item, read by [`Gpu::stats_parse`].
    fn stats_queue(&mut self, items: &[(u64, Option<u64>, usize)]) -> Result<Buf> {
        let bytes = items.len().max(1) * STAT_WORDS * 8;
        self.counters.metric_passes += items.len() as u64;
        let acc = self.alloc(bytes)?;
        self.memset(acc.ptr, 0, bytes)?;
        let one = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: 0,
        };
        for (k, &(x, r, n)) in items.iter().enumerate() {
            let a = acc.ptr + (k * STAT_WORDS * 8) as u64;
            let r0 = r.unwrap_or(0);
            self.launch(
                "fused_stats",
                n as u64,
                &[A::P(x), A::P(r0), A::U(n as u64), A::P(a), A::P(a + 40)],
            )?;
            if r.is_some() {
                self.launch_cfg(
                    "stats_pick",
                    one,
                    &[
                        A::P(x),
                        A::P(r0),
                        A::U(n as u64),
                        A::P(a + 40),
                        A::P(a + 128),
                    ],
                )?;
            }
        }
        Ok(acc)
    }

    /// Statistics and comparisons from [`Gpu::stats_queue`]'s words, per item (n, has reference).
    fn stats_parse(items: &[(usize, bool)], raw: &[u64]) -> Vec<(Stats, Option<Compare>)> {
        items
            .iter()
            .zip(raw.chunks(STAT_WORDS))
            .map(|(&(n, has_ref), v)| {
                let a: [f64; 5] = std::array::from_fn(|j| f64::from_bits(v[j]));
                let c: [u64; 11] = std::array::from_fn(|j| v[5 + j]);
                let (x, r) = (v[16], v[17]);
                Self::stats_of(n, &a, &c, has_ref, |_| {
                    (x >> 32 == 1).then(|| (f32::from_bits(x as u32), f32::from_bits(r as u32)))
                })
            })
            .collect()
    }

    /// Stats and comparison from `fused_stats`' sums and counters; `at(i)` gives (x[i], r[i])
    /// for the largest error's index.
    fn stats_of(
        n: usize,
        a: &[f64; 5],
        c: &[u64; 11],
        has_ref: bool,
        at: impl FnOnce(usize) -> Option<(f32, f32)>,
    ) -> (Stats, Option<Compare>) {
        let f = |v: u64| f32::from_bits(v as u32) as f64;
        let finite = c[3] as usize;
        let stats = Stats {
            numel: n,
            amax: f(c[6]),
            mean_abs: if finite > 0 {
                a[0] / finite as f64
            } else {
                0.0
            },
            nan: c[0] as usize,
            inf: c[1] as usize,
            zeros: c[2] as usize,
        };
        let cmp = has_ref.then(|| {
            let max_err = (c[10] > 0)
                .then(|| (0xFFFF_FFFFu64 - (c[9] & 0xFFFF_FFFF)) as usize)
                .and_then(|idx| {
                    let (xa, ra) = at(idx)?;
                    Some(((xa as f64 - ra as f64).abs(), idx))
                });
            Compare::from_sums(&PairSums {
                dot: a[1],
                nx: a[2],
                nr: a[3],
                ne: a[4],
                ax: f(c[7]),
                ar: f(c[8]),
                max_err,
                any_non_finite: c[5] > 0,
                new_non_finite: c[4] as usize,
            })
        });
        (stats, cmp)
    }

    /// Upload host tensors once and compute, for each (x, reference) pair, x's statistics and the
    /// comparison; pairs with `None` give statistics only. One synchronization for all pairs.
    pub fn metrics(
        &mut self,
        tensors: &[&Data],
        pairs: &[(usize, Option<usize>)],
    ) -> Result<Vec<(Stats, Option<Compare>)>> {
        let p = self.metrics_launch(tensors, pairs)?;
        self.metrics_collect(p)
    }

    /// [`Gpu::metrics`] without waiting: the statistics kernels, the pick of the values at each
    /// comparison's largest error, and the copy of the results into a pinned slot are queued on
    /// the stream; [`Gpu::metrics_collect`] reads them.
    pub fn metrics_launch(
        &mut self,
        tensors: &[&Data],
        pairs: &[(usize, Option<usize>)],
    ) -> Result<PendingMetrics> {
        for &(i, j) in pairs {
            let n = tensors[i].len();
            if let Some(j) = j {
                if tensors[j].len() != n {
                    return Err(Error::Backend(format!(
                        "metrics: length mismatch {n} vs {}",
                        tensors[j].len()
                    )));
                }
            }
        }
        let bytes = pairs.len() * STAT_WORDS * 8;
        if bytes > METRIC_SLOT {
            return Err(Error::Backend(format!(
                "metrics: {} pairs in one call (at most {})",
                pairs.len(),
                METRIC_SLOT / 8 / STAT_WORDS
            )));
        }
        let bufs: Vec<DevRef> = tensors
            .iter()
            .map(|t| self.input(t))
            .collect::<Result<_>>()?;
        let items: Vec<(u64, Option<u64>, usize)> = pairs
            .iter()
            .map(|&(i, j)| (bufs[i].ptr, j.map(|j| bufs[j].ptr), tensors[i].len()))
            .collect();
        let acc = self.stats_queue(&items)?;
        if self.metric_free.is_empty() {
            self.add_metric_block()?;
        }
        let slot = self.metric_free.pop().expect("refilled above");
        let dst = unsafe { std::slice::from_raw_parts_mut(slot as *mut u8, bytes) };
        let copied = self.timed("copy device->host (metrics)", || {
            unsafe { dres::memcpy_dtoh_async(dst, acc.ptr, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("copy to host", e))
        });
        let ev = copied.and_then(|_| {
            let ev = self.ctx.new_event(None).map_err(|e| cuda_err("event", e))?;
            ev.record(&self.stream).map_err(|e| cuda_err("event", e))?;
            Ok(ev)
        });
        let ev = match ev {
            Ok(ev) => ev,
            Err(e) => {
                self.metric_free.push(slot);
                return Err(e);
            }
        };
        Ok(PendingMetrics {
            slot,
            ev,
            items: pairs
                .iter()
                .map(|&(i, j)| (tensors[i].len(), j.is_some()))
                .collect(),
            _keep: bufs,
            _acc: acc,
        })
    }

    /// Pin one more block of [`METRIC_SLOTS_PER_BLOCK`] metrics slots.
    fn add_metric_block(&mut self) -> Result<()> {
        let blk = unsafe { dres::malloc_host(METRIC_SLOT * METRIC_SLOTS_PER_BLOCK, 0) }
            .map_err(|e| cuda_err("pinned metrics slots", e))? as *mut u8;
        self.metric_blocks.push(blk);
        self.metric_free
            .extend((0..METRIC_SLOTS_PER_BLOCK).map(|i| blk as usize + i * METRIC_SLOT));
        Ok(())
    }

    /// The results of [`Gpu::metrics_launch`], once its copy has landed.
    pub fn metrics_collect(&mut self, p: PendingMetrics) -> Result<Vec<(Stats, Option<Compare>)>> {
        let waited = {
            let _s = crate::profile::span("host: metrics wait");
            let t0 = Instant::now();
            let r = p.ev.synchronize();
            crate::profile::interval("metrics wait", 0, t0);
            r
        };
        let n = p.items.len() * STAT_WORDS;
        let raw: Vec<u64> = unsafe { std::slice::from_raw_parts(p.slot as *const u64, n) }.to_vec();
        self.metric_free.push(p.slot);
        waited.map_err(|e| cuda_err("kernel execution", e))?;
        Ok(Self::stats_parse(&p.items, &raw))
    }
}
