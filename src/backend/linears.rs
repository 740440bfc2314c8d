//! The CUDA implementation of the linears' interface (`served::Linears`): the served recipe, the
//! oracles' GEMMs and the fused routed experts on the device (`cuda::Gpu`), bit for bit the
//! host reference's (`served::CpuLinears`). The run's environment holds it as a `dyn Linears`
//! and never asks which machine runs its linears.

use std::sync::{Arc, Mutex, MutexGuard};

use super::cuda::Gpu;
use crate::served::{FusedExperts, LinearCtx, Linears, Observed, PathKind};
use crate::tensor::Data;
use crate::{Result, Tensor};

/// The device's linears; the `Gpu` is shared with the run's `CudaDevice` and statistics.
pub struct CudaLinears(pub Arc<Mutex<Gpu>>);

/// The device state, or a clear error when an earlier failure poisoned it.
pub fn lock(g: &Mutex<Gpu>) -> Result<MutexGuard<'_, Gpu>> {
    g.lock().map_err(|_| {
        crate::Error::Backend("cuda: the device state was poisoned by an earlier failure".into())
    })
}

fn whole(obs: Option<crate::served::LinearObs>) -> Observed {
    obs.map(|o| (String::new(), o)).into_iter().collect()
}

impl Linears for CudaLinears {
    fn linear(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
    ) -> Result<(Data, usize, Observed)> {
        let (y, n, obs) = lock(&self.0)?.linear(ctx, kind, base, x, m)?;
        Ok((y, n, whole(obs)))
    }

    fn linear_grouped(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        rows: usize,
        groups: usize,
    ) -> Result<(Data, usize, Observed)> {
        let (y, r, obs) = lock(&self.0)?.linear_grouped(ctx, kind, base, x, rows, groups)?;
        Ok((y, r, whole(obs)))
    }

    fn linear_rows(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
        r0: usize,
        n: usize,
    ) -> Result<(Data, Observed)> {
        let (y, _, obs) = lock(&self.0)?.linear_rows(ctx, kind, base, x, m, Some((r0, n)))?;
        Ok((y, whole(obs)))
    }

    fn pin_nvfp4(
        &mut self,
        ctx: &LinearCtx,
        base: &str,
        scales: Option<&[u8]>,
        swap: bool,
    ) -> Result<()> {
        lock(&self.0)?.pin_nvfp4_served(ctx, base, scales, swap)
    }

    fn unpin(&mut self, base: &str) {
        if let Ok(mut g) = self.0.lock() {
            g.forget_served(base);
        }
    }

    fn experts(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        layer: usize,
        x: &Tensor,
        per: &[Vec<(usize, f32)>],
        k: usize,
        bases: &[&str],
        limit: f32,
        observe: bool,
    ) -> Option<Result<FusedExperts>> {
        Some(
            lock(&self.0)
                .and_then(|mut g| g.experts(ctx, kind, layer, x, per, k, bases, limit, observe)),
        )
    }

    fn begin_op(&mut self, ctx: &LinearCtx, op: &crate::model::graph::Op) -> Result<bool> {
        use crate::model::graph::OpKind;
        match op.kind {
            // an op made of linears: its weights in one parallel read and one copy per batch
            OpKind::Linear | OpKind::GroupedLinear | OpKind::SharedExpert => {
                let bases: Vec<&str> = op.weights.iter().map(String::as_str).collect();
                lock(&self.0)?.preload(ctx.ckpt, &bases)?;
                Ok(false)
            }
            // every path's routed experts (and the isolated and FP32-on-BF16 ones) only begin;
            // the flush runs them interleaved, chunk by chunk of experts as the loader brings
            // them (`cuda::experts`); routed experts load themselves once routed
            OpKind::Experts => Ok(lock(&self.0)?.defer_experts()),
            _ => Ok(false),
        }
    }

    fn cancel_op(&mut self) {
        if let Ok(mut g) = self.0.lock() {
            g.cancel_deferred();
        }
    }

    fn deferring(&self) -> bool {
        lock(&self.0).is_ok_and(|g| g.deferring())
    }

    fn flush_experts(&mut self, ctx: &LinearCtx) -> Result<Vec<Observed>> {
        lock(&self.0)?.experts_flush(ctx)
    }

    fn clear(&mut self) {
        if let Ok(mut g) = self.0.lock() {
            g.clear_weights();
        }
    }
}
