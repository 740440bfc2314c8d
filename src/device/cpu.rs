//! The host reference of every op on the [`Device`] interface: `kern`'s reductions (f64 sums,
//! one rounding), `ops`' RoPE and RMSNorm, the f64 GEMM of the mHC mixing rows; the path's
//! storage rounding is the `store` the device was made with (`OpEnv::store`).

use rayon::prelude::*;

use super::gemm::matmul_nt;
use super::kern::{self, AttnDims, CmpKeys, HcParams, Scoring};
use super::ops::{rmsnorm_rows, silu, RopeTable};
use super::Device;
use crate::{Result, Tensor};

/// The host device of one path: `store` rounds what the path stores.
pub struct CpuDevice<S: Fn(&mut Tensor)> {
    store: S,
}

impl<S: Fn(&mut Tensor)> CpuDevice<S> {
    pub fn new(store: S) -> Self {
        CpuDevice { store }
    }
}

/// m = (xf @ fnᵀ)·ρ per token with ρ = rsqrt(mean(xf²) + eps): the GEMM accumulates in f64 like
/// every linear, ρ is `kern::rms_inv`.
fn hc_mix(x: &Tensor, f: &Tensor, rows_out: usize, eps: f32) -> Vec<f32> {
    let t = x.shape[0];
    let w = x.numel() / t.max(1);
    let mut m = matmul_nt(&x.data, &f.data, t, w, rows_out);
    kern::hc_scale_rows(&mut m, &x.data, t, rows_out, eps);
    m
}

impl<S: Fn(&mut Tensor)> Device for CpuDevice<S> {
    fn repeat_rows(&self, x: &Tensor, d: usize, hc: usize) -> Result<Tensor> {
        let t = x.numel() / d.max(1);
        let mut data = Vec::with_capacity(t * hc * d);
        for row in x.data.chunks(d) {
            for _ in 0..hc {
                data.extend_from_slice(row);
            }
        }
        Ok(Tensor::new(vec![t, hc, d], data))
    }

    fn rmsnorm(&self, x: &Tensor, w: &[f32], eps: f32) -> Result<Tensor> {
        let mut y = x.clone();
        rmsnorm_rows(&mut y.data, x.cols(), Some(w), eps);
        (self.store)(&mut y);
        Ok(y)
    }

    fn rope(&self, x: &Tensor, dh: usize, nope: usize, tab: &RopeTable) -> Result<Tensor> {
        let mut y = x.clone();
        for (p, row) in y.data.chunks_mut(dh).enumerate() {
            tab.apply(&mut row[nope..], p, false);
        }
        (self.store)(&mut y);
        Ok(y)
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
        let mut y = q.clone();
        y.data
            .par_chunks_mut(h * dh)
            .enumerate()
            .for_each(|(p, row)| {
                for head in row.chunks_mut(dh) {
                    rmsnorm_rows(head, dh, None, eps);
                    tab.apply(&mut head[nope..], p, false);
                }
            });
        (self.store)(&mut y);
        Ok(y)
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
        let hc = p.hc;
        let mix = f.numel() / (hc * d).max(1);
        let m = hc_mix(x, f, mix, rms_eps);
        let (pre, post, comb) = kern::hc_coeffs_rows(&m, p, t);
        let mut y = Tensor::new(vec![t, d], kern::hc_weighted_sum(&x.data, &pre, t, hc, d));
        (self.store)(&mut y);
        Ok((
            y,
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
        let mut out = Tensor::new(
            vec![t, hc, d],
            kern::hc_post(&y.data, &x.data, &post.data, &comb.data, t, hc, d),
        );
        (self.store)(&mut out);
        Ok(out)
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
        let m = hc_mix(x, f, hc, rms_eps);
        let mut y = Tensor::new(
            vec![t, d],
            kern::hc_weighted_sum(&x.data, &coef(&m), t, hc, d),
        );
        (self.store)(&mut y);
        Ok(y)
    }

    fn attention(
        &self,
        q: &Tensor,
        kv: &Tensor,
        cmp: &Tensor,
        keys: CmpKeys,
        sink: &[f32],
        dims: AttnDims,
        nope: usize,
        tab: &RopeTable,
    ) -> Result<Tensor> {
        let (t, dh) = (dims.t, dims.dh);
        let hd = dims.h * dh;
        let out = kern::attention_core(&q.data, &kv.data, &cmp.data, keys, sink, dims);
        let mut out = Tensor::new(vec![t, hd], out);
        (self.store)(&mut out);
        for (pos, row) in out.data.chunks_mut(hd).enumerate() {
            for head in row.chunks_mut(dh) {
                tab.apply(&mut head[nope..], pos, true);
            }
        }
        (self.store)(&mut out);
        Ok(out)
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
        // the rope covers the last 2·half dims (the config keeps the rope dim even)
        let rd = 2 * tab.half;
        let mut ck = Tensor::new(
            vec![n_c, dc],
            kern::compress_pool(&a.data, &g.data, ape, n_c, dc, ratio),
        );
        (self.store)(&mut ck);
        rmsnorm_rows(&mut ck.data, dc, Some(norm), eps);
        (self.store)(&mut ck);
        for (b, row) in ck.data.chunks_mut(dc).enumerate() {
            tab.apply(&mut row[dc - rd..], b, false);
        }
        (self.store)(&mut ck);
        Ok(ck)
    }

    fn indexer_scores(
        &self,
        q: &[f32],
        ki: &[f32],
        w: &[f32],
        t: usize,
        hi: usize,
        di: usize,
        n_c: usize,
    ) -> Result<Vec<f32>> {
        Ok(kern::indexer_scores(q, ki, w, t, hi, di, n_c))
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
        Ok(kern::route(&logits.data, bias, t, e, k, f, norm, rs))
    }

    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let mut y = Tensor::new(
            a.shape.clone(),
            a.data
                .iter()
                .zip(&b.data)
                .map(|(x, y)| x + y)
                .collect::<Vec<f32>>(),
        );
        (self.store)(&mut y);
        Ok(y)
    }

    fn swiglu(&self, g: &Tensor, u: &Tensor, limit: f32) -> Result<Tensor> {
        let mut a = g.clone();
        for (g, u) in a.data.iter_mut().zip(&u.data) {
            let (mut g2, mut u2) = (*g, *u);
            if limit > 0.0 {
                g2 = g2.min(limit);
                u2 = u2.clamp(-limit, limit);
            }
            *g = silu(g2) * u2;
        }
        (self.store)(&mut a);
        Ok(a)
    }
}
