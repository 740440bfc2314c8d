//! The layer's non-linear ops on the device (`kernels/layer.cu`): RMSNorm, RoPE, mHC pre/post/head
//! with Sinkhorn, the attention core, the compressor's pooling tail, the indexer's scores and the
//! router's top-k. Each takes and returns host tensors and computes what `device::kern` computes,
//! bit for bit, including the path's storage rounding (`round`) at the points where the host op
//! calls its store. [`CudaDevice`] puts them behind the `device::Device` interface that
//! `model::exec` calls.

use std::sync::{Arc, Mutex};

use cudarc::driver::LaunchConfig;

use super::cuda::Gpu;
use crate::device::kern::{self, AttnDims, CmpKeys, HcParams, IndexerDims, Scoring};
use crate::device::ops::RopeTable;
use crate::device::{CmpRows, CpuDevice, Device};
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
        let y = dev.with(|g| {
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
        let sel = self
            .dev
            .with(|g| g.indexer_topk(&q.data, &ki.data, &w.data, w_scale, d, rows))?;
        Ok(Tensor::new(vec![d.t, d.kk], sel))
    }

    fn route(
        &self,
        logits: &Tensor,
        bias: &[f32],
        t: usize,
        e: usize,
        k: usize,
        f: Scoring,
        norm: bool,
        rs: f32,
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        self.dev
            .with(|g| g.route(&logits.data, bias, t, e, k, f, norm, rs))
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
}

/// Largest dynamic shared memory the attention kernel asks for without opting in.
const SMEM_DEFAULT: usize = 48 << 10;

/// Threads of one `indexer_topk` block (`TOPK_THREADS` in kernels/layer.cu).
const TOPK_THREADS: u32 = 256;

/// The dynamic shared memory of `attn_core` for queries of up to `max_keys` keys (32 doubles,
/// then a score and a key row per key), None when it exceeds [`SMEM_DEFAULT`].
fn attn_smem(max_keys: usize) -> Option<usize> {
    let smem = 32 * 8 + max_keys * 8;
    (smem <= SMEM_DEFAULT).then_some(smem)
}

/// Device address of row `row` of a row-major f32/i32 matrix of `width` columns at `base`.
fn row_at(base: u64, row: usize, width: usize) -> u64 {
    base + (row * width * 4) as u64
}

/// What one `attn_core` launch reads and writes: device addresses (q, kv, the key lists and the
/// output at the launch's first query and kv row) and the keys' description.
struct AttnLaunch {
    q: u64,
    kv: u64,
    cmp: u64,
    sel: u64,
    kk: usize,
    has_sel: bool,
    ratio: usize,
    sink: u64,
    out: u64,
    max_keys: usize,
    smem: usize,
}

impl Gpu {
    /// An output buffer filled with 0xFF (NaN as f32) before the kernel writes it, so an element
    /// a kernel forgets shows up as NaN instead of stale data.
    fn out(&self, bytes: usize) -> Result<super::cuda::Buf> {
        let b = self.alloc(bytes)?;
        self.memset(b.ptr, 0xFF, bytes)?;
        Ok(b)
    }

    fn round_in_place(&self, p: u64, n: usize, round: bool) -> Result<()> {
        if round {
            self.kern().round_bf16(n as u64, p, n as u64, 0)?;
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
    /// place, row p with row p of `tab`.
    #[allow(clippy::too_many_arguments)]
    fn rope_dev(
        &self,
        x: u64,
        rows: usize,
        nh: usize,
        dh: usize,
        off: usize,
        tab: &RopeTable,
        inverse: bool,
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
            inverse as i32,
        )?;
        self.sync()
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
        let xb = self.input_copy(q)?;
        let rb = self.out(rows * h * 4)?;
        self.row_rms_dev(xb.ptr, rows * h, dh, eps, rb.ptr)?;
        self.rms_apply_dev(xb.ptr, rows * h, dh, rb.ptr, 0, false, xb.ptr)?;
        self.rope_dev(xb.ptr, rows, h, dh, nope, tab, false)?;
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
        self.rope_dev(xb.ptr, rows, nh, dh, off, tab, inverse)?;
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
            (t * hc * d) as u64,
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

    /// One `attn_core` launch over the queries of `a` (a chunk: its q0 and kv0 say where the
    /// launch's addresses start in the prompt).
    fn attn_core_launch(&self, l: &AttnLaunch, a: AttnDims) -> Result<()> {
        let n = a.t * a.h;
        if n == 0 {
            return Ok(());
        }
        let cfg = LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: l.smem as u32,
        };
        self.kern().attn_core(
            cfg,
            l.q,
            l.kv,
            l.cmp,
            l.sel,
            l.kk as u64,
            l.has_sel as i32,
            l.ratio as u64,
            l.sink,
            a.t as u64,
            a.h as u64,
            a.dh as u64,
            a.n_c as u64,
            a.win as u64,
            l.max_keys as u64,
            a.q0 as u64,
            a.kv0 as u64,
            a.scale,
            l.out,
        )
    }

    /// The attention core (`kern::attention_core`) of one block of queries, None when a query's
    /// keys do not fit the kernel's shared memory (the caller computes it on the host). The
    /// compressed rows travel as the per-query description (causal count, selection lists
    /// [t, kk]), never as a mask.
    pub fn attention_core(
        &mut self,
        q: &Data,
        kv: &Data,
        cmp: &Data,
        keys: CmpKeys,
        sink: &[f32],
        a: AttnDims,
    ) -> Result<Option<Data>> {
        let max_keys = a.win + keys.max_rows(a.n_c);
        let Some(smem) = attn_smem(max_keys) else {
            return Ok(None);
        };
        if a.win > 0 && a.kv0 > (a.q0 + 1).saturating_sub(a.win) {
            return Err(Error::Backend(format!(
                "cuda: attention kv rows from {} miss the window of the query at {}",
                a.kv0, a.q0
            )));
        }
        let n = a.t * a.h;
        let (sel, kk) = match keys.sel {
            Some((s, kk)) => (s, kk),
            None => (&[-1i32][..], 0),
        };
        let (qb, kb, cb, ab, sb) = (
            self.input(q)?,
            self.input(kv)?,
            self.input(cmp)?,
            self.upload(sel)?,
            self.upload(sink)?,
        );
        let ob = self.out(n * a.dh * 4)?;
        let l = AttnLaunch {
            q: qb.ptr,
            kv: kb.ptr,
            cmp: cb.ptr,
            sel: ab.ptr,
            kk,
            has_sel: keys.sel.is_some(),
            ratio: keys.ratio,
            sink: sb.ptr,
            out: ob.ptr,
            max_keys,
            smem,
        };
        self.attn_core_launch(&l, a)?;
        Ok(Some(self.output(ob, n * a.dh, false)))
    }

    /// The attention op over a whole prompt (`Device::attention`): the selection's per-query
    /// lists made on the device (`sel_lists`, which also finds an entry that is neither −1 nor a
    /// row < n_c), then per chunk of `chunk` queries the core, rounding, inverse RoPE and
    /// rounding, in place in the op's one output [t, h·dh]. Inputs already on the device are
    /// read there; nothing comes back to the host but the selection check's word, once per op.
    /// None when a query's keys do not fit the kernel's shared memory (the caller computes the op
    /// on the host).
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &mut self,
        q: &Data,
        kv: &Data,
        cmp: &Data,
        ratio: usize,
        sel: Option<(&Data, usize)>,
        sink: &[f32],
        a: AttnDims,
        nope: usize,
        tab: &RopeTable,
        chunk: usize,
        round: bool,
    ) -> Result<Option<Data>> {
        let cmp_keys = match sel {
            _ if ratio == 0 => 0,
            Some((_, kk)) => kk.min(a.n_c),
            None => a.n_c,
        };
        let max_keys = a.win + cmp_keys;
        let Some(smem) = attn_smem(max_keys) else {
            return Ok(None);
        };
        let (t, h, dh) = (a.t, a.h, a.dh);
        let (hd, half) = (h * dh, tab.half);
        if a.q0 != 0 || a.kv0 != 0 {
            return Err(Error::usage(
                "attention: the device takes the whole prompt (q0 = kv0 = 0)",
            ));
        }
        if q.len() != t * hd
            || kv.len() != t * dh
            || cmp.len() < a.n_c * dh
            || sink.len() < h
            || sel.is_some_and(|(s, kk)| s.len() != t * kk)
            || (half > 0 && (tab.cos.len() < t * half || nope + 2 * half > dh))
        {
            return Err(Error::Backend(format!(
                "cuda: attention of q {}, kv {}, compressed {}, sink {}, selection {:?}, rope table {} rows × {half} for {a:?}",
                q.len(),
                kv.len(),
                cmp.len(),
                sink.len(),
                sel.map(|(s, kk)| (s.len(), kk)),
                tab.cos.len() / half.max(1),
            )));
        }
        let n = t * hd;
        let ob = self.out(n * 4)?;
        if n == 0 {
            return Ok(Some(self.output(ob, 0, round)));
        }
        let (qb, kb, cb, sb) = (
            self.input(q)?,
            self.input(kv)?,
            self.input(cmp)?,
            self.upload(sink)?,
        );
        // the per-query lists [t, kk] (i32) and the first bad entry's index (all ones: none)
        let kk = sel.map_or(0, |(_, kk)| kk);
        let (lists, check) = match sel {
            Some((s, kk)) if kk > 0 => {
                let sp = self.input(s)?;
                let lb = self.alloc(t * kk * 4)?;
                let bad = self.alloc(8)?;
                self.memset(bad.ptr, 0xFF, 8)?;
                self.kern().sel_lists(
                    t as u64,
                    sp.ptr,
                    t as u64,
                    kk as u64,
                    a.n_c as u64,
                    lb.ptr,
                    bad.ptr,
                )?;
                (lb, Some((bad, sp)))
            }
            _ => (self.upload(&[-1i32])?, None),
        };
        // the table's rows of every query, uploaded once; each chunk reads its own rows
        let (cs, sn) = (
            self.upload(&tab.cos[..t * half])?,
            self.upload(&tab.sin[..t * half])?,
        );
        for (q0, q1) in kern::chunks(t, chunk) {
            let part = a.chunk(q0, q1);
            let l = AttnLaunch {
                q: row_at(qb.ptr, q0, hd),
                kv: row_at(kb.ptr, part.kv0, dh),
                cmp: cb.ptr,
                sel: if kk > 0 {
                    row_at(lists.ptr, q0, kk)
                } else {
                    lists.ptr
                },
                kk,
                has_sel: sel.is_some(),
                ratio,
                sink: sb.ptr,
                out: row_at(ob.ptr, q0, hd),
                max_keys,
                smem,
            };
            self.attn_core_launch(&l, part)?;
            let rows = q1 - q0;
            self.round_in_place(l.out, rows * hd, round)?;
            if half > 0 {
                self.kern().rope_rows(
                    (rows * h * half) as u64,
                    l.out,
                    rows as u64,
                    h as u64,
                    dh as u64,
                    nope as u64,
                    half as u64,
                    row_at(cs.ptr, q0, half),
                    row_at(sn.ptr, q0, half),
                    1,
                )?;
            }
            self.round_in_place(l.out, rows * hd, round)?;
        }
        if let Some((bad, sp)) = check {
            let first: Vec<u64> = self.download(bad.ptr, 1)?;
            if first[0] != u64::MAX {
                let v: Vec<f32> = self.download(sp.ptr + first[0] * 4, 1)?;
                return Err(Error::usage(kern::selection_error_msg(v[0], a.n_c)));
            }
        }
        Ok(Some(self.output(ob, n, round)))
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
        self.rope_dev(ob.ptr, n_c, 1, dc, dc - 2 * tab.half, tab, false)?;
        self.round_in_place(ob.ptr, n, round)?;
        Ok(self.output(ob, n, round))
    }

    /// `kern::indexer_scores`: [t, n_c].
    #[allow(clippy::too_many_arguments)]
    pub fn indexer_scores(
        &mut self,
        q: &[f32],
        ki: &[f32],
        w: &[f32],
        t: usize,
        hi: usize,
        di: usize,
        n_c: usize,
    ) -> Result<Vec<f32>> {
        let (qb, kb, wb) = (self.upload(q)?, self.upload(ki)?, self.upload(w)?);
        let ob = self.out(t * n_c * 4)?;
        self.kern().indexer_scores(
            (t * n_c * 32) as u64,
            qb.ptr,
            kb.ptr,
            wb.ptr,
            t as u64,
            hi as u64,
            di as u64,
            n_c as u64,
            ob.ptr,
        )?;
        self.download(ob.ptr, t * n_c)
    }

    /// The indexer's selection on the device (`kern::indexer_topk`): w · w_scale, then per block
    /// of `rows` queries their scores against the rows the block's last query sees
    /// (`indexer_scores`, into one scratch of at most rows × n_c) and each query's top kk
    /// (`indexer_topk`, one CUDA block per query) into the output [t, kk]. The scores never
    /// leave the device; nothing is read back.
    pub fn indexer_topk(
        &mut self,
        q: &Data,
        ki: &Data,
        w: &Data,
        w_scale: f32,
        d: IndexerDims,
        rows: usize,
    ) -> Result<Data> {
        let IndexerDims {
            t,
            hi,
            di,
            n_c,
            ratio,
            kk,
        } = d;
        if q.len() != t * hi * di || ki.len() < n_c * di || w.len() != t * hi {
            return Err(Error::Backend(format!(
                "cuda: indexer top-k of q {}, keys {}, weights {} for {d:?}",
                q.len(),
                ki.len(),
                w.len()
            )));
        }
        let ob = self.out(t * kk * 4)?;
        if t == 0 || kk == 0 {
            return Ok(self.output(ob, t * kk, false));
        }
        let rows = rows.clamp(1, t);
        let (qb, kb) = (self.input(q)?, self.input(ki)?);
        let wb = self.input_copy(w)?;
        self.kern()
            .scale_round((t * hi) as u64, wb.ptr, (t * hi) as u64, w_scale, 0)?;
        let m_max = d.causal(t - 1);
        let sb = self.alloc(if m_max > kk { rows * m_max * 4 } else { 0 })?;
        for (t0, t1) in kern::chunks(t, rows) {
            let (nq, m_b) = (t1 - t0, d.causal(t1 - 1));
            if m_b > kk {
                self.kern().indexer_scores(
                    (nq * m_b * 32) as u64,
                    row_at(qb.ptr, t0, hi * di),
                    kb.ptr,
                    row_at(wb.ptr, t0, hi),
                    nq as u64,
                    hi as u64,
                    di as u64,
                    m_b as u64,
                    sb.ptr,
                )?;
            }
            let cfg = LaunchConfig {
                grid_dim: (nq as u32, 1, 1),
                block_dim: (TOPK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            self.kern().indexer_topk(
                cfg,
                sb.ptr,
                nq as u64,
                m_b as u64,
                t0 as u64,
                ratio as u64,
                n_c as u64,
                kk as u64,
                ob.ptr,
            )?;
        }
        Ok(self.output(ob, t * kk, false))
    }

    /// The `indexer_topk` kernel alone on given scores (for the self-test): query i of `rows`
    /// at position t0 + i selects from its causal rows of scores [rows, ld]; returns the rows
    /// t0.. of the selection [t0 + rows, kk] (`kern::topk_rows` of each).
    #[allow(clippy::too_many_arguments)]
    pub fn indexer_topk_of_scores(
        &mut self,
        scores: &[f32],
        rows: usize,
        ld: usize,
        t0: usize,
        ratio: usize,
        n_c: usize,
        kk: usize,
    ) -> Result<Vec<f32>> {
        if scores.len() < rows * ld || n_c > ld {
            return Err(Error::Backend(format!(
                "cuda: {} scores for {rows} rows × {ld} (n_c {n_c})",
                scores.len()
            )));
        }
        let sb = self.upload(scores)?;
        let ob = self.out((t0 + rows) * kk * 4)?;
        if rows > 0 && kk > 0 {
            let cfg = LaunchConfig {
                grid_dim: (rows as u32, 1, 1),
                block_dim: (TOPK_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            self.kern().indexer_topk(
                cfg,
                sb.ptr,
                rows as u64,
                ld as u64,
                t0 as u64,
                ratio as u64,
                n_c as u64,
                kk as u64,
                ob.ptr,
            )?;
        }
        let all: Vec<f32> = self.download(ob.ptr, (t0 + rows) * kk)?;
        Ok(all[t0 * kk..].to_vec())
    }

    /// `kern::route` on the device: (weights [t, k], expert ids [t, k]).
    #[allow(clippy::too_many_arguments)]
    pub fn route(
        &mut self,
        logits: &Data,
        bias: &[f32],
        t: usize,
        e: usize,
        k: usize,
        f: Scoring,
        norm: bool,
        rs: f32,
    ) -> Result<(Vec<f32>, Vec<usize>)> {
        let (lb, bb) = (self.input(logits)?, self.upload(bias)?);
        let wb = self.out(t * k * 4)?;
        let ib = self.out(t * k * 4)?;
        self.kern().route_topk(
            t as u64,
            lb.ptr,
            bb.ptr,
            t as u64,
            e as u64,
            k as u64,
            f as i32,
            norm as i32,
            rs,
            wb.ptr,
            ib.ptr,
        )?;
        let idx: Vec<f32> = self.download(ib.ptr, t * k)?;
        Ok((
            self.download(wb.ptr, t * k)?,
            idx.iter().map(|&v| v as usize).collect(),
        ))
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
        self.swiglu_clamp(gb.ptr, ub.ptr, n, limit, round, ob.ptr)?;
        Ok(self.output(ob, n, round))
    }
}
