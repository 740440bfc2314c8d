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
//!
//! The device state [`Gpu`] is defined here with its construction, device memory and scratch
//! buffers; its methods are spread over the files of this module by concern: `transfer`
//! (host ↔ device copies, pinned staging), `kernels` (the kernel table and launches), `gemm`,
//! `weights` (stored weights on the device, preloading, dequantization), `served_weight` (the
//! served reading of a weight), `linear` (the linears of every path), `moe` and `experts` (the
//! routed-experts op), `stats` (statistics, metrics slots, kernel timer), `image` (shipped CUBINs).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use cudarc::cublas::{result as blas, sys as bsys, CudaBlas};
use cudarc::driver::{
    result as dres, sys as dsys, CudaContext, CudaEvent, CudaFunction, CudaStream, DevicePtr,
    LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;

use crate::checkpoint::Checkpoint;
use crate::metrics::{Compare, PairSums, Partial, Stats};
use crate::numerics::nvfp4::{Convention, QuantHealth};
use crate::served::faults::Fault;
use crate::served::PathKind;
use crate::served::{
    self, ActQuant, LinearObs, Nvfp4Params, Override, Profile, ServedWeight, WeightOperand,
};
use crate::tensor::Data;
use crate::{Error, Result, Tensor};

mod experts;
mod gemm;
pub mod image;
mod kernels;
pub mod launch;
mod linear;
mod metrics;
mod moe;
mod served_weight;
mod transfer;
mod weights;

pub(crate) use super::stage::STAGE;
pub use super::stage::{Buf, Mem};
pub(crate) use gemm::GEMM_ROWS;
pub use image::KERNEL_SOURCE;
pub use kernels::{
    ActQuantOut, AqSeg, MoeKernel, MoeTile, Nvfp4Decode, AQ_KERNELS, AQ_KERNEL_DEFAULT, MMA_R,
    MOE_R, MT_EPI, MT_POST, MT_SWAP, MT_WBF16,
};
pub use metrics::{KernelTimer, PendingMetrics};
pub use moe::ExpertsOut;
pub use transfer::{Bounce, DevRef, DevTensor};

use launch::KERNELS;
use linear::WRows;
use moe::{aq_segs, MoeAct};
use served_weight::{served_key, PreparedLayout, ServedDev};
use weights::{DevFmt, DevWeight};

/// Health slots per served linear (7 counters + the activation amax as f32 bits).
pub const H_SLOTS: usize = 8;

fn cuda_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Backend(format!("cuda: {what}: {e:?}"))
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

/// Which element type a GEMM operand holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Ty {
    F32,
    Bf16,
}

pub use crate::served::LinearCtx;

/// GEMM-class work given to the device, in flops (a multiply and an add are two), by kind: the
/// exact f64 GEMMs of the linears (`Gpu::gemm`), the grouped routed experts (`moe_gemm_f64`),
/// the hardware FP32/BF16 GEMMs, the attention's two products and the indexer's scores. The
/// profile (`NVFP4_PROBE_PROFILE=1`) states the run against it: the FLOP floor.
#[derive(Debug, Default, serde::Serialize)]
pub struct Work {
    pub dgemm: std::cell::Cell<f64>,
    pub experts: std::cell::Cell<f64>,
    pub native: std::cell::Cell<f64>,
    pub attention: std::cell::Cell<f64>,
    pub indexer: std::cell::Cell<f64>,
}

impl Work {
    pub fn add(c: &std::cell::Cell<f64>, flops: f64) {
        c.set(c.get() + flops);
    }

    pub fn total(&self) -> f64 {
        self.dgemm.get()
            + self.experts.get()
            + self.native.get()
            + self.attention.get()
            + self.indexer.get()
    }
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
    /// GEMM-class work given to the device ([`Work`]).
    pub work: Work,
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
    /// The grouped experts' GEMM kernel: on the FP64 tensor cores (`moe_mmt_f64`, tiles of
    /// [`MMA_R`] rows, any number of rows per expert, weights decoded through a per-tile table)
    /// unless `NVFP4_PROBE_MOE_KERNEL` says otherwise when the backend opened (`mma`:
    /// `moe_mma_f64`, weights staged; `fma`: `moe_gemm_f64`, tiles of
    /// [`MOE_R`] rows, experts of at most [`GROUPED_MAX_ROWS`](moe::GROUPED_MAX_ROWS) rows); the
    /// self-test checks every one ([`MoeKernel::ALL`]).
    pub moe_kernel: MoeKernel,
    /// The V4 attention op runs as batched DGEMMs around a softmax kernel (`attn_blas`, FP64
    /// tensor cores) rather than one `attn_core` block per (query, head). True unless
    /// `NVFP4_PROBE_ATTN=kernel` was set when the backend opened; the self-test checks both.
    pub attn_blas: bool,
    /// The pinned buffer small device → host reads go through.
    bounce: Arc<Bounce>,
    /// Per-launch device timing, when `NVFP4_PROBE_KERNEL_TIME=1` was set at open.
    ktimer: Option<std::cell::RefCell<KernelTimer>>,
    /// Wait for every launch and cuBLAS call and name the one a device fault came from
    /// (`NVFP4_PROBE_SYNC_CHECK=1` at open; slow, for diagnosis).
    sync_check: bool,
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
            work: Work::default(),
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
            moe_kernel: MoeKernel::from_env(),
            attn_blas: std::env::var("NVFP4_PROBE_ATTN")
                .ok()
                .as_deref()
                .map(str::trim)
                != Some("kernel"),
            bounce,
            sync_check: std::env::var("NVFP4_PROBE_SYNC_CHECK").ok().as_deref() == Some("1"),
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
    pub(crate) fn scratch(&mut self, name: &'static str, bytes: usize) -> Result<u64> {
        if self.scratch.get(name).is_none_or(|b| b.bytes < bytes) {
            self.scratch.remove(name);
            let b = self.alloc(bytes.next_power_of_two().max(1 << 16))?;
            self.scratch.insert(name, b);
        }
        Ok(self.scratch[name].ptr)
    }

    pub fn sync(&self) -> Result<()> {
        let _s = crate::profile::span("host: sync");
        self.stream
            .synchronize()
            .map_err(|e| cuda_err("kernel execution", e))
    }

    pub fn memset(&self, dst: u64, byte: u8, bytes: usize) -> Result<()> {
        self.timed("memset", || {
            unsafe { dres::memset_d8_async(dst, byte, bytes, self.stream.cu_stream()) }
                .map_err(|e| cuda_err("memset", e))
        })
    }
}
