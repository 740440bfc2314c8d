//! The layer's non-linear ops on the device (`kernels/layer.cu`): RMSNorm, RoPE (interleaved or
//! half-split pairs), mHC pre/post/head with Sinkhorn, the compressor's pooling tail, the router's
//! top-k, the model families' column slice and gpt-oss GLU (the attention ops — V4's, the
//! families' grouped-query attention and MLA's key gather — and the indexer's selection are in
//! `attn.rs`). Each takes and returns host tensors and computes what
//! `device::kern` computes, bit for bit, including the path's storage rounding (`round`) at the
//! points where the host op calls its store. [`CudaDevice`] puts them behind the
//! `device::Device` interface that `model::exec` calls.

use std::sync::{Arc, Mutex};

use super::cuda::Gpu;
use crate::device::cpu::{gqa_sizes, mla_sizes};
use crate::device::family::{GqaDims, MlaDims};
use crate::device::kern::{self, AttnDims, HcParams, IndexerDims, Routing};
use crate::device::ops::RopeTable;
use crate::device::{CmpRows, CpuDevice, Device, GluIn};
use crate::tensor::Data;
use crate::{Error, Result, Tensor};

/// The device a path's host ops run on, and whether its `store` rounds to BF16.
#[derive(Clone)]
pub struct Dev {
    pub gpu: Arc<Mutex<Gpu>>,
    pub round: bool,
}

impl Dev {
    /// Run `f` with the device locked.
    pub fn with<R>(&self, f: impl FnOnce(&mut Gpu) -> Result<R>) -> Result<R> {
        let mut g = self.gpu.lock().map_err(|_| {
            Error::Backend("cuda: the device state was poisoned by an earlier failure".into())
        })?;
        f(&mut g)
    }
}

/// The [`Device`] of a path on the GPU: every op on the device with the path's rounding; the host
/// device (with the path's store) computes what the device kernels decline (an attention whose
/// scores do not fit the kernel's shared memory).
pub struct CudaDevice<S: Fn(&mut Tensor)> {
    dev: Dev,
    host: CpuDevice<S>,
}

impl<S: Fn(&mut Tensor)> CudaDevice<S> {
    pub fn new(dev: Dev, store: S) -> Self {
        CudaDevice {
            dev,
            host: CpuDevice::new(store),
        }
    }
}

impl<S: Fn(&mut Tensor)> Device for CudaDevice<S> {
    fn repeat_rows(&self, x: &Tensor, d: usize, hc: usize) -> Result<Tensor> {
        let t = x.numel() / d.max(1);
        let y = self.dev.with(|g| g.repeat_rows(&x.data, d, hc))?;
        Ok(Tensor::new(vec![t, hc, d], y))
    }

    fn rmsnorm(&self, x: &Tensor, w: &[f32], eps: f32) -> Result<Tensor> {
        let dev = &self.dev;
        let y = dev.with(|g| g.rmsnorm(&x.data, x.cols(), Some(w), eps, dev.round))?;
        Ok(Tensor::new(x.shape.clone(), y))
    }

    fn rope(&self, x: &Tensor, dh: usize, nope: usize, tab: &RopeTable) -> Result<Tensor> {
        let dev = &self.dev;
        let cols = x.cols();
        if dh == 0 || !cols.is_multiple_of(dh) {
            return Err(Error::usage(format!(
                "rope: rows of {cols} values are not heads of {dh}"
            )));
        }
        let y = dev.with(|g| g.rope(&x.data, cols / dh, dh, nope, tab, false, dev.round))?;
        Ok(Tensor::new(x.shape.clone(), y))
    }

    fn q_rope(
        &self,
        q: &Tensor,
        h: usize,
        dh: usize,
        nope: usize,
        tab: &RopeTable,
        eps: f32,
    ) -> Result<Tensor> {
        let dev = &self.dev;
        let y = dev.with(|g| g.q_rope(&q.data, h, dh, nope, tab, eps, dev.round))?;
        Ok(Tensor::new(q.shape.clone(), y))
    }

    fn hc_pre(
        &self,
        x: &Tensor,
        t: usize,
        d: usize,
        f: &Tensor,
        p: &HcParams,
        rms_eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let dev = &self.dev;
        let hc = p.hc;
        let (y, post, comb) =
            dev.with(|g| g.hc_pre(&x.data, t, d, &f.data, p, rms_eps, dev.round))?;
        Ok((
            Tensor::new(vec![t, d], y),
            Tensor::new(vec![t, hc], post),
            Tensor::new(vec![t, hc, hc], comb),
        ))
    }

    fn hc_post(
        &self,
        y: &Tensor,
        x: &Tensor,
        post: &Tensor,
        comb: &Tensor,
        t: usize,
        hc: usize,
        d: usize,
    ) -> Result<Tensor> {
        let dev = &self.dev;
        let out = dev.with(|g| {
            g.hc_post(
                &y.data, &x.data, &post.data, &comb.data, t, hc, d, dev.round,
            )
        })?;
        Ok(Tensor::new(vec![t, hc, d], out))
    }

    fn hc_head(
        &self,
        x: &Tensor,
        t: usize,
        d: usize,
        hc: usize,
        f: &Tensor,
        rms_eps: f32,
        coef: &dyn Fn(&[f32]) -> Vec<f32>,
    ) -> Result<Tensor> {
        let dev = &self.dev;
        let y = dev.with(|g| g.hc_head(&x.data, t, d, hc, &f.data, rms_eps, coef, dev.round))?;
        Ok(Tensor::new(vec![t, d], y))
    }

    fn attention(
        &self,
        q: &Tensor,
        kv: &Tensor,
        cmp: &Tensor,
        keys: CmpRows,
        sink: &[f32],
        dims: AttnDims,
        nope: usize,
        tab: &RopeTable,
        chunk: usize,
    ) -> Result<Tensor> {
        let dev = &self.dev;
        let sel = keys.sel.map(|s| (&s.data, s.cols()));
        // the work of the two products (the floor the profile states)
        let n_keys = dims.keys(keys.ratio, sel.map(|s| s.1));
        let flops = 4.0 * (dims.h * dims.dh) as f64 * n_keys as f64;
        let y = dev.with(|g| {
            crate::backend::cuda::Work::add(&g.work.attention, flops);
            g.attention(
                &q.data, &kv.data, &cmp.data, keys.ratio, sel, sink, dims, nope, tab, chunk,
                dev.round,
            )
        })?;
        match y {
            Some(y) => Ok(Tensor::new(vec![dims.t, dims.h * dims.dh], y)),
            None => self
                .host
                .attention(q, kv, cmp, keys, sink, dims, nope, tab, chunk),
        }
    }

    fn compress_tail(
        &self,
        a: &Tensor,
        g: &Tensor,
        ape: &[f32],
        norm: &[f32],
        n_c: usize,
        dc: usize,
        ratio: usize,
        eps: f32,
        tab: &RopeTable,
    ) -> Result<Tensor> {
        let dev = &self.dev;
        let ck = dev.with(|gp| {
            gp.compress_tail(
                &a.data, &g.data, ape, norm, n_c, dc, ratio, eps, tab, dev.round,
            )
        })?;
        Ok(Tensor::new(vec![n_c, dc], ck))
    }

    fn indexer_topk(
        &self,
        q: &Tensor,
        ki: &Tensor,
        w: &Tensor,
        w_scale: f32,
        d: IndexerDims,
    ) -> Result<Tensor> {
        let rows = kern::score_block_rows(d.n_c);
        let flops = 2.0 * (d.hi * d.di) as f64 * d.scored() as f64;
        let sel = self.dev.with(|g| {
            crate::backend::cuda::Work::add(&g.work.indexer, flops);
            g.indexer_topk(&q.data, &ki.data, &w.data, w_scale, d, rows)
        })?;
        Ok(Tensor::new(vec![d.t, d.kk], sel))
    }

    fn route(&self, logits: &Tensor, bias: &[f32], r: Routing) -> Result<(Vec<f32>, Vec<usize>)> {
        self.dev.with(|g| g.route(&logits.data, bias, r))
    }

    fn hash_route(&self, logits: &Tensor, idx: &[usize], r: Routing) -> Result<Vec<f32>> {
        self.dev.with(|g| g.hash_route(&logits.data, idx, r))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let dev = &self.dev;
        let y = dev.with(|g| g.add(&a.data, &b.data, dev.round))?;
        Ok(Tensor::new(a.shape.clone(), y))
    }

    fn swiglu(&self, g: &Tensor, u: &Tensor, limit: f32) -> Result<Tensor> {
        let dev = &self.dev;
        let y = dev.with(|gp| gp.swiglu(&g.data, &u.data, limit, dev.round))?;
        Ok(Tensor::new(g.shape.clone(), y))
    }

    fn rope_split(&self, x: &Tensor, dh: usize, nope: usize, tab: &RopeTable) -> Result<Tensor> {
        let dev = &self.dev;
        let cols = x.cols();
        if dh == 0 || !cols.is_multiple_of(dh) || nope + 2 * tab.half > dh {
            // the host's check and message
            return self.host.rope_split(x, dh, nope, tab);
        }
        let y = dev.with(|g| g.rope_split(&x.data, cols / dh, dh, nope, tab, dev.round))?;
        Ok(Tensor::new(x.shape.clone(), y))
    }

    fn cat_rows(&self, parts: &[(&Tensor, std::ops::Range<usize>)]) -> Result<Tensor> {
        let (shape, w) = crate::device::cat_shape(parts)?;
        let spans: Vec<(&crate::tensor::Data, usize, usize)> = parts
            .iter()
            .map(|(t, r)| (&t.data, r.start * w, r.len() * w))
            .collect();
        let y = self.dev.with(|g| g.cat_spans(&spans))?;
        Ok(Tensor::new(shape, y))
    }

    fn kv_cache_fp8(&self, x: &Tensor, nope: usize, group: usize) -> Result<Tensor> {
        if nope > x.cols() || group == 0 {
            return self.host.kv_cache_fp8(x, nope, group);
        }
        let y = self
            .dev
            .with(|g| g.kv_cache_fp8(&x.data, x.cols(), nope, group))?;
        Ok(Tensor::new(x.shape.clone(), y))
    }

    fn slice_cols(&self, x: &Tensor, c0: usize, w: usize) -> Result<Tensor> {
        if c0 + w > x.cols() {
            return self.host.slice_cols(x, c0, w);
        }
        let y = self.dev.with(|g| g.slice_cols(&x.data, x.cols(), c0, w))?;
        Ok(Tensor::new(vec![x.rows(), w], y))
    }

    fn gqa(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&[f32]>,
        dims: GqaDims,
    ) -> Result<Tensor> {
        if !dims.fits(q.numel(), k.numel(), v.numel(), sinks.map(<[f32]>::len)) {
            return Err(gqa_sizes(q, k, v, sinks, dims));
        }
        let dev = &self.dev;
        let y = dev.with(|g| g.gqa(&q.data, &k.data, &v.data, sinks, dims, dev.round))?;
        match y {
            Some(y) => Ok(Tensor::new(vec![dims.t, dims.h * dims.dv], y)),
            None => self.host.gqa(q, k, v, sinks, dims),
        }
    }

    fn mla_keys(&self, kvb: &Tensor, kva: &Tensor, d: MlaDims) -> Result<(Tensor, Tensor)> {
        mla_sizes(kvb, kva, d)?;
        let (k, v) = self.dev.with(|g| g.mla_keys(&kvb.data, &kva.data, d))?;
        Ok((
            Tensor::new(vec![d.t, d.h * (d.nope + d.rope)], k),
            Tensor::new(vec![d.t, d.h * d.dv], v),
        ))
    }

    fn glu_oss(&self, gu: GluIn<'_>, limit: f32) -> Result<Tensor> {
        let (n, i) = gu.dims()?;
        let dev = &self.dev;
        let (gate, up) = match gu {
            GluIn::Interleaved(gu) => (&gu.data, None),
            GluIn::Split(g, u) => (&g.data, Some(&u.data)),
        };
        let h = dev.with(|g| g.glu_oss(gate, up, n * i, limit, dev.round))?;
        Ok(Tensor::new(vec![n, i], h))
    }
}

/// `rope_rows`' mode bits: the inverse rotation (−sin), transformers' half-split pairs.
pub(super) const ROPE_INVERSE: i32 = 1;
pub(super) const ROPE_SPLIT: i32 = 2;

/// Which experts `route_topk` weighs: the top k of score + bias, or ids given by a hash table.
enum Pick<'a> {
    TopK(&'a [f32]),
    Given(&'a [usize]),
}

impl Gpu {
    /// An output buffer filled with 0xFF (NaN as f32) before the kernel writes it, so an element
    /// a kernel forgets shows up as NaN instead of stale data.
    pub(super) fn out(&self, bytes: usize) -> Result<super::cuda::Buf> {
        let b = self.alloc(bytes)?;
        self.memset(b.ptr, 0xFF, bytes)?;
        Ok(b)
    }

    pub(super) fn round_in_place(&self, p: u64, n: usize, round: bool) -> Result<()> {
        if round {
            self.kern().round_bf16(n as u64, p, p, n as u64, 0)?;
        }
        Ok(())
    }

    /// ρ per row of x [rows, cols] into `r`.
    fn row_rms_dev(&self, x: u64, rows: usize, cols: usize, eps: f32, r: u64) -> Result<()> {
        self.kern()
            .row_rms((rows * 32) as u64, x, rows as u64, cols as u64, eps, r)
    }

    #[allow(clippy::too_many_arguments)]
    fn rms_apply_dev(
        &self,
        x: u64,
        rows: usize,
        cols: usize,
        r: u64,
        w: u64,
        round: bool,
        out: u64,
    ) -> Result<()> {
        self.kern().rms_apply(
            (rows * cols) as u64,
            x,
            rows as u64,
            cols as u64,
            r,
            w,
            round as i32,
            out,
        )
    }

    /// Rotate dims [off, off + 2·half) of each of `nh` heads of width `dh` in x [rows, nh·dh] in
    /// place, row p with row p of `tab`; `mode`: [`ROPE_INVERSE`], [`ROPE_SPLIT`] or 0.
    #[allow(clippy::too_many_arguments)]
    fn rope_dev(
        &self,
        x: u64,
        rows: usize,
        nh: usize,
        dh: usize,
        off: usize,
        tab: &RopeTable,
        mode: i32,
    ) -> Result<()> {
        if tab.half == 0 || rows == 0 {
            return Ok(());
        }
        if tab.cos.len() < rows * tab.half || off + 2 * tab.half > dh {
            return Err(Error::Backend(format!(
                "cuda: rope table of {} rows × {} for {rows} rows, dims {off}+{} of {dh}",
                tab.cos.len() / tab.half,
                tab.half,
                2 * tab.half
            )));
        }
        let c = self.upload(&tab.cos[..rows * tab.half])?;
        let s = self.upload(&tab.sin[..rows * tab.half])?;
        self.kern().rope_rows(
            (rows * nh * tab.half) as u64,
            x,
            rows as u64,
            nh as u64,
            dh as u64,
            off as u64,
            tab.half as u64,
            c.ptr,
            s.ptr,
            mode,
        )
        // no sync: the table's copies took the host values before returning and its device
        // buffers are freed in the stream's order (a sync here held every RoPE op's host until
        // the queued GEMMs were done: ~35 ms per V4-Flash layer at 4,096 tokens on the H200)
    }

    /// RMSNorm of each row of x [rows, cols] with weight `w` (or none), then the path's rounding.
    pub fn rmsnorm(
        &mut self,
        x: &Data,
        cols: usize,
        w: Option<&[f32]>,
        eps: f32,
        round: bool,
    ) -> Result<Data> {
        let n = x.len();
        let rows = n / cols.max(1);
        let xb = self.input(x)?;
        let rb = self.out(rows * 4)?;
        let wb = w.map(|w| self.upload(w)).transpose()?;
        let ob = self.out(n * 4)?;
        self.row_rms_dev(xb.ptr, rows, cols, eps, rb.ptr)?;
        self.rms_apply_dev(
            xb.ptr,
            rows,
            cols,
            rb.ptr,
            wb.as_ref().map_or(0, |b| b.ptr),
            round,
            ob.ptr,
        )?;
        Ok(self.output(ob, n, round))
    }

    /// The q path's per-head RMSNorm without weight, RoPE on dims [nope, dh) of each head at
    /// position = row, then the path's rounding. q [t, h·dh].
    #[allow(clippy::too_many_arguments)]
    pub fn q_rope(
        &mut self,
        q: &Data,
        h: usize,
        dh: usize,
        nope: usize,
        tab: &RopeTable,
        eps: f32,
        round: bool,
    ) -> Result<Data> {
        let n = q.len();
        let rows = n / (h * dh).max(1);
        // the norm reads q where it is and writes every element of the new buffer (no copy first)
        let qb = self.input(q)?;
        let xb = self.alloc(n * 4)?;
        let rb = self.out(rows * h * 4)?;
        self.row_rms_dev(qb.ptr, rows * h, dh, eps, rb.ptr)?;
        self.rms_apply_dev(qb.ptr, rows * h, dh, rb.ptr, 0, false, xb.ptr)?;
        self.rope_dev(xb.ptr, rows, h, dh, nope, tab, 0)?;
        self.round_in_place(xb.ptr, n, round)?;
        Ok(self.output(xb, n, round))
    }

    /// RoPE of dims [off, off + 2·half) of each head with transformers' half-split pairs
    /// (`RopeTable::apply_split`), then the path's rounding.
    pub fn rope_split(
        &mut self,
        x: &Data,
        nh: usize,
        dh: usize,
        off: usize,
        tab: &RopeTable,
        round: bool,
    ) -> Result<Data> {
        let n = x.len();
        let rows = n / (nh * dh).max(1);
        let xb = self.input_copy(x)?;
        self.rope_dev(xb.ptr, rows, nh, dh, off, tab, ROPE_SPLIT)?;
        self.round_in_place(xb.ptr, n, round)?;
        Ok(self.output(xb, n, round))
    }

    /// RoPE of dims [off, off + 2·half) of each head, then the path's rounding.
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &mut self,
        x: &Data,
        nh: usize,
        dh: usize,
        off: usize,
        tab: &RopeTable,
        inverse: bool,
        round: bool,
    ) -> Result<Data> {
        let n = x.len();
        let rows = n / (nh * dh).max(1);
        let xb = self.input_copy(x)?;
        let mode = if inverse { ROPE_INVERSE } else { 0 };
        self.rope_dev(xb.ptr, rows, nh, dh, off, tab, mode)?;
        self.round_in_place(xb.ptr, n, round)?;
        Ok(self.output(xb, n, round))
    }

    /// (x [t, w] · fᵀ [rows_out, w]) scaled per token by ρ (f64-accumulated GEMM, as
    /// `kern::hc_scale_rows` after `served::matmul_nt`), left on the device with x.
    fn hc_mix_dev(
        &mut self,
        x: &Data,
        t: usize,
        f: &Data,
        rows_out: usize,
        eps: f32,
    ) -> Result<(super::cuda::DevRef, super::cuda::Buf)> {
        let w = x.len() / t.max(1);
        let xb = self.input(x)?;
        // a parameter the op's paths share: uploaded by the first, attached to it since
        let fb = self.input(f)?;
        let mb = self.out(t * rows_out * 4)?;
        self.gemm(
            super::cuda::Ty::F32,
            xb.ptr,
            w,
            fb.ptr,
            mb.ptr,
            rows_out,
            t,
            rows_out,
            w,
        )?;
        let rb = self.out(t * 4)?;
        self.row_rms_dev(xb.ptr, t, w, eps, rb.ptr)?;
        self.rms_apply_dev(mb.ptr, t, rows_out, rb.ptr, 0, false, mb.ptr)?;
        Ok((xb, mb))
    }

    /// mHC pre (docs/DSV4-LAYER.md §3.1): the mixing GEMM, coefficients with Sinkhorn, the weighted
    /// sum of the streams (rounded by the path). x [t, hc, d], f [mix, hc·d]. Returns
    /// (y [t, d], post [t, hc], comb [t, hc, hc]).
    #[allow(clippy::too_many_arguments)]
    pub fn hc_pre(
        &mut self,
        x: &Data,
        t: usize,
        d: usize,
        f: &Data,
        p: &HcParams,
        rms_eps: f32,
        round: bool,
    ) -> Result<(Data, Data, Data)> {
        let hc = p.hc;
        if hc > 8 {
            return Err(Error::Backend(format!(
                "cuda: hc_mult {hc} > 8 is not supported by the device kernel"
            )));
        }
        let mix = 2 * hc + hc * hc;
        let (xb, mb) = self.hc_mix_dev(x, t, f, mix, rms_eps)?;
        let sb = self.upload(p.scale)?;
        let bb = self.upload(p.base)?;
        let pre = self.out(t * hc * 4)?;
        let post = self.out(t * hc * 4)?;
        let comb = self.out(t * hc * hc * 4)?;
        self.kern().hc_coeffs(
            t as u64,
            mb.ptr,
            t as u64,
            mix as u64,
            hc as u64,
            sb.ptr,
            bb.ptr,
            p.iters as u64,
            p.eps,
            pre.ptr,
            post.ptr,
            comb.ptr,
        )?;
        let yb = self.out(t * d * 4)?;
        self.hc_wsum_dev(xb.ptr, pre.ptr, t, hc, d, round, yb.ptr)?;
        Ok((
            self.output(yb, t * d, round),
            self.output(post, t * hc, false),
            self.output(comb, t * hc * hc, false),
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn hc_wsum_dev(
        &self,
        x: u64,
        coef: u64,
        t: usize,
        hc: usize,
        d: usize,
        round: bool,
        y: u64,
    ) -> Result<()> {
        self.kern().hc_wsum(
            (t * d) as u64,
            x,
            coef,
            t as u64,
            hc as u64,
            d as u64,
            round as i32,
            y,
        )
    }

    /// mHC head: the mixing GEMM over hc rows; `coef` turns each token's scaled mixing row into
    /// the stream weights (on the host: hc sigmoids per token), then the weighted sum.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_head(
        &mut self,
        x: &Data,
        t: usize,
        d: usize,
        hc: usize,
        f: &Data,
        rms_eps: f32,
        coef: impl Fn(&[f32]) -> Vec<f32>,
        round: bool,
    ) -> Result<Data> {
        let (xb, mb) = self.hc_mix_dev(x, t, f, hc, rms_eps)?;
        let m: Vec<f32> = self.download(mb.ptr, t * hc)?;
        let cb = self.upload(&coef(&m))?;
        let yb = self.out(t * d * 4)?;
        self.hc_wsum_dev(xb.ptr, cb.ptr, t, hc, d, round, yb.ptr)?;
        Ok(self.output(yb, t * d, round))
    }

    /// mHC post: out [t, hc, d] = post · y + combᵀ · x, rounded by the path.
    #[allow(clippy::too_many_arguments)]
    pub fn hc_post(
        &mut self,
        y: &Data,
        x: &Data,
        post: &Data,
        comb: &Data,
        t: usize,
        hc: usize,
        d: usize,
        round: bool,
    ) -> Result<Data> {
        let (yb, xb, pb, cb) = (
            self.input(y)?,
            self.input(x)?,
            self.input(post)?,
            self.input(comb)?,
        );
        let ob = self.out(t * hc * d * 4)?;
        self.kern().hc_post(
            (t * d) as u64,
            yb.ptr,
            xb.ptr,
            pb.ptr,
            cb.ptr,
            t as u64,
            hc as u64,
            d as u64,
            round as i32,
            ob.ptr,
        )?;
        Ok(self.output(ob, t * hc * d, round))
    }

    /// `kern::compress_pool` alone (no rounding).
    pub fn compress_pool(
        &mut self,
        a: &[f32],
        g: &[f32],
        ape: &[f32],
        n_c: usize,
        dc: usize,
        ratio: usize,
    ) -> Result<Vec<f32>> {
        let (ab, gb, pb) = (self.upload(a)?, self.upload(g)?, self.upload(ape)?);
        let ob = self.out(n_c * dc * 4)?;
        self.pool_dev(ab.ptr, gb.ptr, pb.ptr, n_c, dc, ratio, ob.ptr)?;
        self.download(ob.ptr, n_c * dc)
    }

    #[allow(clippy::too_many_arguments)]
    fn pool_dev(
        &self,
        a: u64,
        g: u64,
        ape: u64,
        n_c: usize,
        dc: usize,
        ratio: usize,
        out: u64,
    ) -> Result<()> {
        self.kern().compress_pool(
            (n_c * dc) as u64,
            a,
            g,
            ape,
            n_c as u64,
            dc as u64,
            ratio as u64,
            out,
        )
    }

    /// The compressor after its two projections (docs/DSV4-LAYER.md §3.5.1): pooling, rounding,
    /// RMSNorm with `norm`, rounding, RoPE on the last `tab.half·2` dims at the table's rows,
    /// rounding. Returns [n_c, dc].
    #[allow(clippy::too_many_arguments)]
    pub fn compress_tail(
        &mut self,
        a: &Data,
        g: &Data,
        ape: &[f32],
        norm: &[f32],
        n_c: usize,
        dc: usize,
        ratio: usize,
        eps: f32,
        tab: &RopeTable,
        round: bool,
    ) -> Result<Data> {
        let (ab, gb, pb, nb) = (
            self.input(a)?,
            self.input(g)?,
            self.upload(ape)?,
            self.upload(norm)?,
        );
        let n = n_c * dc;
        let ob = self.out(n * 4)?;
        self.pool_dev(ab.ptr, gb.ptr, pb.ptr, n_c, dc, ratio, ob.ptr)?;
        self.round_in_place(ob.ptr, n, round)?;
        let rb = self.out(n_c * 4)?;
        self.row_rms_dev(ob.ptr, n_c, dc, eps, rb.ptr)?;
        self.rms_apply_dev(ob.ptr, n_c, dc, rb.ptr, nb.ptr, round, ob.ptr)?;
        self.rope_dev(ob.ptr, n_c, 1, dc, dc - 2 * tab.half, tab, 0)?;
        self.round_in_place(ob.ptr, n, round)?;
        Ok(self.output(ob, n, round))
    }

    /// `kern::route` on the device: (weights [t, k], expert ids [t, k]).
    pub fn route(
        &mut self,
        logits: &Data,
        bias: &[f32],
        r: Routing,
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        let out = self.route_dev(logits, r, Pick::TopK(bias))?;
        // weights then ids, in one read
        let mut wts: Vec<f32> = self.download(out.ptr, 2 * r.t * r.k)?;
        let idx = wts.split_off(r.t * r.k);
        Ok((wts, idx.iter().map(|&v| v as usize).collect()))
    }

    /// `kern::hash_route_weights` on the device: the weights [t, k] of the experts `idx` [t, k]
    /// (valid ids, from the hash router's table). The logits stay on the device; only the
    /// weights come back.
    pub fn hash_route(&mut self, logits: &Data, idx: &[usize], r: Routing) -> Result<Vec<f32>> {
        let out = self.route_dev(logits, r, Pick::Given(idx))?;
        self.download(out.ptr, r.t * r.k)
    }

    /// `route_topk` into a new device buffer: the weights [t, k], then the ids [t, k] as f32, of
    /// the experts `pick` says.
    fn route_dev(&mut self, logits: &Data, r: Routing, pick: Pick) -> Result<super::cuda::Buf> {
        let Routing {
            t,
            e,
            k,
            f,
            norm,
            rs,
        } = r;
        let lb = self.input(logits)?;
        // the kernel reads the bias only to select, the given ids only when there are some
        let (bb, gb) = match pick {
            Pick::TopK(bias) => (Some(self.upload(bias)?), None),
            Pick::Given(ids) => {
                let ids: Vec<f32> = ids.iter().map(|&i| i as f32).collect();
                (None, Some(self.upload(&ids)?))
            }
        };
        let out = self.out(2 * t * k * 4)?;
        let (wts, ids) = (out.ptr, out.ptr + (t * k * 4) as u64);
        self.kern().route_topk(
            t as u64,
            lb.ptr,
            bb.as_ref().map_or(0, |b| b.ptr),
            t as u64,
            e as u64,
            k as u64,
            f as i32,
            norm as i32,
            rs,
            gb.as_ref().map_or(0, |b| b.ptr),
            wts,
            ids,
        )?;
        Ok(out)
    }

    /// a + b ([`Data`] of equal length), then the path's rounding.
    pub fn add(&mut self, a: &Data, b: &Data, round: bool) -> Result<Data> {
        let n = a.len();
        if b.len() != n {
            return Err(Error::Backend(format!(
                "cuda: add of {n} and {} elements",
                b.len()
            )));
        }
        let (ab, bb) = (self.input(a)?, self.input(b)?);
        let ob = self.out(n * 4)?;
        self.kern()
            .add_f32(n as u64, ab.ptr, bb.ptr, n as u64, ob.ptr)?;
        self.round_in_place(ob.ptr, n, round)?;
        Ok(self.output(ob, n, round))
    }

    /// Each row of x [t, d] repeated `hc` times: [t, hc, d] (the hc_mult expansion).
    pub fn repeat_rows(&mut self, x: &Data, d: usize, hc: usize) -> Result<Data> {
        let t = x.len() / d.max(1);
        let idx: Vec<i32> = (0..t * hc).map(|r| (r / hc.max(1)) as i32).collect();
        let xb = self.input(x)?;
        let ib = self.upload(&idx)?;
        let ob = self.out(t * hc * d * 4)?;
        self.gather_rows(xb.ptr, ib.ptr, t * hc, d, ob.ptr)?;
        let out = self.output(ob, t * hc * d, false);
        if let Some(e) = x.known_bf16_exact() {
            out.set_bf16_exact(e);
        }
        Ok(out)
    }

    /// SwiGLU with the clamp on stored gate and up projections (`model::env::swiglu_hidden`'s last
    /// step): a = silu(min(g, L)) · clamp(u, ±L), then the path's rounding.
    pub fn swiglu(&mut self, g: &Data, u: &Data, limit: f32, round: bool) -> Result<Data> {
        let n = g.len();
        if u.len() != n {
            return Err(Error::Backend(format!(
                "cuda: swiglu of {n} and {} elements",
                u.len()
            )));
        }
        let (gb, ub) = (self.input(g)?, self.input(u)?);
        let ob = self.out(n * 4)?;
        self.swiglu_clamp(gb.ptr, ub.ptr, n, limit, round, false, ob.ptr)?;
        Ok(self.output(ob, n, round))
    }
}
