//! The device state's copies and the ops that only the other model families use
//! (`device::Device::cat_rows`, `kv_cache_fp8`, `slice_cols`, `glu_oss`; `backend::layer::CudaDevice`
//! calls them): rows joined on the device (a token chunk's carried state), the FP8 KV cache's
//! reading of earlier prefill chunks' keys, a column slice (MLA's latent) and gpt-oss's clamped
//! GLU, each bit for bit its host reference (`device::family`, `device::cpu`).

use super::cuda::Gpu;
use crate::tensor::Data;
use crate::{Error, Result};

impl Gpu {
    /// The spans (values, first value, count) one after the other in one new allocation (a copy
    /// on the device; host values are uploaded first): `Device::cat_rows`.
    pub fn cat_spans(&mut self, spans: &[(&Data, usize, usize)]) -> Result<Data> {
        let n: usize = spans.iter().map(|s| s.2).sum();
        let ob = self.out(n * 4)?;
        let mut at = 0u64;
        for &(x, off, len) in spans {
            if off + len > x.len() {
                return Err(Error::Backend(format!(
                    "cuda: values {off}..{} of {}",
                    off + len,
                    x.len()
                )));
            }
            if len > 0 {
                let src = self.input(x)?;
                self.copy_on_device(ob.ptr + at, src.ptr + (off * 4) as u64, len)?;
            }
            at += (len * 4) as u64;
        }
        let exact = spans.iter().all(|s| s.0.known_bf16_exact() == Some(true));
        Ok(self.output(ob, n, exact))
    }

    /// Rows of x [.., cols] as an engine's FP8 cache gives them back (`Device::kv_cache_fp8`):
    /// columns [0, nope) quantize-dequantized per `group` with a power-of-two scale, the rest
    /// copied.
    pub fn kv_cache_fp8(
        &mut self,
        x: &Data,
        cols: usize,
        nope: usize,
        group: usize,
    ) -> Result<Data> {
        let rows = x.len() / cols.max(1);
        if nope > cols || group == 0 || rows * cols != x.len() {
            return Err(Error::Backend(format!(
                "cuda: kv cache of {nope} quantized dims of {} values in rows of {cols}",
                x.len()
            )));
        }
        let xb = self.input(x)?;
        let ob = self.out(rows * cols * 4)?;
        let groups = nope.div_ceil(group) + 1;
        self.kern().kv_cache_fp8(
            (rows * groups) as u64,
            xb.ptr,
            rows as u64,
            cols as u64,
            nope as u64,
            group as u64,
            ob.ptr,
        )?;
        Ok(self.output(ob, rows * cols, false))
    }

    /// Columns [c0, c0 + w) of each row of x [.., cols] (a copy on the device).
    pub fn slice_cols(&mut self, x: &Data, cols: usize, c0: usize, w: usize) -> Result<Data> {
        let rows = x.len() / cols.max(1);
        if c0 + w > cols || rows * cols != x.len() {
            return Err(Error::Backend(format!(
                "cuda: columns {c0}..{} of {} values in rows of {cols}",
                c0 + w,
                x.len()
            )));
        }
        let xb = self.input(x)?;
        let ob = self.out(rows * w * 4)?;
        self.kern().copy_cols(
            (rows * w) as u64,
            xb.ptr,
            rows as u64,
            cols as u64,
            c0 as u64,
            w as u64,
            ob.ptr,
        )?;
        let out = self.output(ob, rows * w, false);
        if x.known_bf16_exact() == Some(true) {
            out.set_bf16_exact(true);
        }
        Ok(out)
    }

    /// gpt-oss's clamped GLU (`device::family::glu_pairs`) of `n` units → [n], then the path's
    /// rounding: the gate and up of unit j at `gate[stride · j]` and `up[stride · j]` (`up` None:
    /// the fused projection `gate` [.., 2I] interleaved, stride 2; else separate projections,
    /// stride 1).
    pub fn glu_oss(
        &mut self,
        gate: &Data,
        up: Option<&Data>,
        n: usize,
        limit: f32,
        round: bool,
    ) -> Result<Data> {
        let gb = self.input(gate)?;
        let (up_ptr, stride, _keep) = match up {
            Some(u) => {
                let ub = self.input(u)?;
                (ub.ptr, 1u64, Some(ub))
            }
            None => (gb.ptr + 4, 2u64, None),
        };
        let ob = self.out(n * 4)?;
        self.kern().glu_oss(
            n as u64,
            gb.ptr,
            up_ptr,
            stride,
            n as u64,
            limit,
            crate::device::family::GLU_ALPHA.to_bits(),
            round as i32,
            ob.ptr,
        )?;
        Ok(self.output(ob, n, round))
    }
}
