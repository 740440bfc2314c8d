//! Where the numerics run. The CPU reference is the op math of `model::exec` on `device::CpuDevice`
//! with the served linears of `served` and the statistics of `metrics`; the CUDA backend
//! ([`cuda::Gpu`]) runs the weight dequantization, activation quantization, GEMMs, the routed
//! experts and the per-op statistics on the device, and the layer's other ops through
//! [`layer::CudaDevice`], under the same `OpEnv` and `Device` interfaces, so both backends share
//! one definition of every op and one runner.

mod attn;
pub mod cuda;
mod family;
pub mod layer;
pub mod linears;
pub mod oom;
pub mod readahead;
pub mod run;
pub mod stage;

use std::sync::{Arc, Mutex};

/// A usable CUDA device, or why there is none. Never panics: the CUDA libraries are loaded
/// dynamically and cudarc panics on a missing library or symbol, so presence is checked first
/// and the first calls run under `catch_unwind`.
pub fn open_cuda() -> std::result::Result<Arc<Mutex<cuda::Gpu>>, String> {
    let present = unsafe {
        cudarc::driver::sys::is_culib_present()
            && cudarc::nvrtc::sys::is_culib_present()
            && cudarc::cublas::sys::is_culib_present()
    };
    if !present {
        return Err(
            "no CUDA driver/NVRTC/cuBLAS libraries found (libcuda.so.1, libnvrtc.so.13, libcublas.so.13)"
                .into(),
        );
    }
    match std::panic::catch_unwind(cuda::Gpu::new) {
        Ok(Ok(g)) => Ok(Arc::new(Mutex::new(g))),
        Ok(Err(e)) => Err(e.to_string()),
        Err(p) => Err(format!(
            "the CUDA libraries failed to load: {}",
            p.downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into())
        )),
    }
}

/// The backend a run uses.
#[derive(Clone, Default)]
pub enum Backend {
    #[default]
    Cpu,
    Cuda(Arc<Mutex<cuda::Gpu>>),
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Cpu => write!(f, "Cpu"),
            Backend::Cuda(_) => write!(f, "Cuda"),
        }
    }
}

impl Backend {
    pub fn name(&self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda(_) => "cuda",
        }
    }
    /// Whether the run's numerics run on a device (not the host).
    pub fn on_device(&self) -> bool {
        matches!(self, Backend::Cuda(_))
    }

    /// The device's (free, total) memory in bytes now; None on the CPU or when the driver does
    /// not say.
    pub fn device_memory(&self) -> Option<(u64, u64)> {
        let g = self.gpu()?.lock().ok()?;
        let (free, total) = g.ctx.mem_get_info().ok()?;
        Some((free as u64, total as u64))
    }

    pub fn gpu(&self) -> Option<&Arc<Mutex<cuda::Gpu>>> {
        match self {
            Backend::Cpu => None,
            Backend::Cuda(g) => Some(g),
        }
    }

    /// The linears of a run on this backend (`served::Linears`).
    pub fn linears(&self) -> Box<dyn crate::served::Linears> {
        match self {
            Backend::Cpu => Box::<crate::served::CpuLinears>::default(),
            Backend::Cuda(g) => Box::new(linears::CudaLinears(g.clone())),
        }
    }

    /// The layer's non-linear ops on this backend (`device::Device`) for one path: `round` says
    /// whether the path stores activations in BF16, `store` is the path's rounding of a tensor.
    pub fn device<'a>(
        &self,
        round: bool,
        store: impl Fn(&mut crate::Tensor) + 'a,
    ) -> Box<dyn crate::device::Device + 'a> {
        match self {
            Backend::Cpu => Box::new(crate::device::CpuDevice::new(store)),
            Backend::Cuda(g) => Box::new(layer::CudaDevice::new(
                layer::Dev {
                    gpu: g.clone(),
                    round,
                },
                store,
            )),
        }
    }

    /// Make values resident on the device, attached to `x` so every later use finds them there
    /// (a parameter read once per op and used by every path); nothing on the CPU.
    pub fn make_resident(&self, x: &crate::tensor::Data) -> crate::Result<()> {
        if let (Backend::Cuda(g), None) = (self, x.device()) {
            linears::lock(g)?.input(x)?;
        }
        Ok(())
    }

    /// Round values held only on the device to BF16 there (no trip through the host); false
    /// when they are on the host or there is no device, for the caller to round on the host.
    pub fn round_resident(&self, x: &mut crate::tensor::Data) -> bool {
        match self {
            Backend::Cuda(g) if !x.on_host() => g.lock().is_ok_and(|g| g.round_data(x).is_ok()),
            _ => false,
        }
    }

    /// Run `body` (the runner) as a run on this backend: the hooks it gets follow the run
    /// (`run::RunHooks`); what the backend started for the run has ended when this returns.
    pub fn run_with<R>(
        &self,
        plan: &run::RunPlan,
        body: impl FnOnce(&dyn run::RunHooks) -> crate::Result<R>,
    ) -> crate::Result<R> {
        match self {
            Backend::Cpu => body(&run::NoHooks),
            Backend::Cuda(g) => run::run_cuda(g, plan, body),
        }
    }

    /// Queue the statistics of `tensors` and the comparisons of `pairs` ((x, reference): the
    /// statistics of x and, with a reference, x against it): on the device one fused pass per
    /// pair, waiting for nothing; on the host computed now. Tensors of unequal lengths are
    /// measured on the host one by one.
    pub fn stats_launch(
        &self,
        tensors: &[&crate::tensor::Data],
        pairs: &[(usize, Option<usize>)],
    ) -> crate::Result<PendingStats> {
        use crate::metrics::{Partial, Stream};
        let same = tensors.iter().all(|x| x.len() == tensors[0].len());
        Ok(match self {
            Backend::Cuda(g) if same => {
                PendingStats::Device(linears::lock(g)?.metrics_launch(tensors, pairs)?)
            }
            _ => {
                let t: Vec<&[f32]> = tensors.iter().map(|d| &d[..]).collect();
                PendingStats::Done(if same {
                    crate::metrics::partials(&t, pairs)
                } else {
                    pairs
                        .iter()
                        .map(|&(i, j)| {
                            // x alone, or x and its reference
                            let x: Vec<&[f32]> =
                                std::iter::once(t[i]).chain(j.map(|j| t[j])).collect();
                            let mut s = Stream::new(x.len(), &[(0, j.map(|_| 1))]);
                            s.feed(&x);
                            s.partials().remove(0)
                        })
                        .collect::<Vec<Partial>>()
                })
            }
        })
    }

    /// The values of [`Backend::stats_launch`]'s statistics, in the order of its pairs.
    pub fn stats_collect(
        &self,
        p: PendingStats,
    ) -> crate::Result<Vec<(crate::metrics::Stats, Option<crate::metrics::Compare>)>> {
        Ok(self
            .stats_partials(p)?
            .iter()
            .map(crate::metrics::Partial::finish)
            .collect())
    }

    /// [`Backend::stats_collect`] before the sums become metrics: what a run in token chunks
    /// merges across its chunks ([`crate::metrics::Partial::merge_later`]).
    pub fn stats_partials(&self, p: PendingStats) -> crate::Result<Vec<crate::metrics::Partial>> {
        match (p, self) {
            (PendingStats::Done(r), _) => Ok(r),
            (PendingStats::Device(p), Backend::Cuda(g)) => linears::lock(g)?.metrics_collect(p),
            (PendingStats::Device(_), Backend::Cpu) => Err(crate::Error::Backend(
                "statistics queued on a device, collected without one".into(),
            )),
        }
    }
}

/// Statistics computed ([`Backend::stats_launch`] on the host), or queued on the device.
pub enum PendingStats {
    Done(Vec<crate::metrics::Partial>),
    Device(cuda::PendingMetrics),
}
