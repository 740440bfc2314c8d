//! Where the numerics run. The CPU reference is the op math of `model::exec` on `device::CpuDevice`
//! with the served linears of `served` and the statistics of `metrics`; the CUDA backend
//! ([`cuda::Gpu`]) runs the weight dequantization, activation quantization, GEMMs, the routed
//! experts and the per-op statistics on the device, and the layer's other ops through
//! [`layer::CudaDevice`], under the same `OpEnv` and `Device` interfaces, so both backends share
//! one definition of every op and one runner.

mod attn;
pub mod cuda;
pub mod layer;
pub mod linears;
pub mod oom;
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
}
