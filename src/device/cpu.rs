//! The host reference of every op on the [`Device`] interface: `kern`'s reductions (f64 sums,
//! one rounding), `ops`' RoPE and RMSNorm, the f64 GEMM of the mHC mixing rows; the path's
//! storage rounding is the `store` the device was made with (`OpEnv::store`).

use rayon::prelude::*;

use super::family::{self, GqaDims, MlaDims};
use super::gemm::matmul_nt;
use super::kern::{self, AttnDims, CmpKeys, HcParams, IndexerDims, Routing};
use super::ops::{rmsnorm_rows, silu, RopeTable};
use super::{CmpRows, Device, GluIn};
use crate::{Error, Result, Tensor};

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
        let cols = x.cols();
        if dh == 0 || !cols.is_multiple_of(dh) {
            return Err(Error::usage(format!(
                "rope: rows of {cols} values are not heads of {dh}"
            )));
        }
        let mut y = x.clone();
        for (p, row) in y.data.chunks_mut(cols).enumerate() {
            for head in row.chunks_mut(dh) {
                tab.apply(&mut head[nope..], p, false);
            }
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
        keys: CmpRows,
        sink: &[f32],
        dims: AttnDims,
        nope: usize,
        tab: &RopeTable,
        chunk: usize,
    ) -> Result<Tensor> {
        let (t, dh) = (dims.t, dims.dh);
        let hd = dims.h * dh;
        if !dims.kv_covers() || kv.numel() != (dims.q0 + t - dims.kv0) * dh {
            return Err(Error::usage(format!(
                "attention: kv of {} values for the rows {}..{} ({dims:?})",
                kv.numel(),
                dims.kv0,
                dims.q0 + t
            )));
        }
        let kk = keys.sel.map_or(0, |s| s.cols());
        let lists = match keys.sel {
            Some(s) => {
                if let Some(v) = kern::selection_error(&s.data, dims.n_c) {
                    return Err(Error::usage(kern::selection_error_msg(v, dims.n_c)));
                }
                Some(kern::selection_lists(&s.data, kk, dims.n_c))
            }
            None => None,
        };
        // Chunks of queries [q0, q1) (this call's rows; positions dims.q0 + …): each sees the
        // kv rows from its first query's window on and every compressed row (the causal count
        // and the lists stay per query), so each query's keys, their order and the result are
        // those of one call over the prompt. One chunk's result is held at a time besides the
        // op's output.
        let one = |q0: usize, q1: usize| -> Tensor {
            let part = dims.sub(q0, q1);
            let k0 = part.kv0 - dims.kv0;
            let ck = CmpKeys {
                ratio: keys.ratio,
                sel: lists.as_deref().map(|l| (&l[q0 * kk..q1 * kk], kk)),
            };
            let y = kern::attention_core(
                &q.data[q0 * hd..q1 * hd],
                &kv.data[k0 * dh..(part.q0 + part.t - dims.kv0) * dh],
                &cmp.data,
                ck,
                sink,
                part,
            );
            let mut y = Tensor::new(vec![q1 - q0, hd], y);
            (self.store)(&mut y);
            for (i, row) in y.data.chunks_mut(hd).enumerate() {
                for head in row.chunks_mut(dh) {
                    tab.apply(&mut head[nope..], q0 + i, true);
                }
            }
            (self.store)(&mut y);
            y
        };
        if chunk >= t {
            return Ok(one(0, t));
        }
        let mut out = Vec::with_capacity(t * hd);
        for (q0, q1) in kern::chunks(t, chunk) {
            out.extend_from_slice(&one(q0, q1).data);
        }
        Ok(Tensor::new(vec![t, hd], out))
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

    fn indexer_topk(
        &self,
        q: &Tensor,
        ki: &Tensor,
        w: &Tensor,
        w_scale: f32,
        d: IndexerDims,
    ) -> Result<Tensor> {
        let IndexerDims { t, hi, di, n_c, .. } = d;
        if q.numel() != t * hi * di || ki.numel() < n_c * di || w.numel() != t * hi {
            return Err(Error::usage(format!(
                "indexer top-k: q of {} values, keys of {}, weights of {} for {d:?}",
                q.numel(),
                ki.numel(),
                w.numel()
            )));
        }
        let w: Vec<f32> = w.data.iter().map(|v| v * w_scale).collect();
        let rows = kern::score_block_rows(n_c);
        let sel = kern::indexer_topk(&q.data, &ki.data, &w, d, rows);
        Ok(Tensor::new(vec![t, d.kk], sel))
    }

    fn route(&self, logits: &Tensor, bias: &[f32], r: Routing) -> Result<(Vec<f32>, Vec<usize>)> {
        Ok(kern::route(&logits.data, bias, r))
    }

    fn hash_route(&self, logits: &Tensor, idx: &[usize], r: Routing) -> Result<Vec<f32>> {
        Ok(kern::hash_route_weights(&logits.data, idx, r))
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

    fn rope_split(&self, x: &Tensor, dh: usize, nope: usize, tab: &RopeTable) -> Result<Tensor> {
        let cols = x.cols();
        if dh == 0 || !cols.is_multiple_of(dh) || nope + 2 * tab.half > dh {
            return Err(Error::usage(format!(
                "rope: rows of {cols} values are not heads of {dh} with {} rotary dims after {nope}",
                2 * tab.half
            )));
        }
        let mut y = x.clone();
        for (p, row) in y.data.chunks_mut(cols).enumerate() {
            for head in row.chunks_mut(dh) {
                tab.apply_split(&mut head[nope..nope + 2 * tab.half], p);
            }
        }
        (self.store)(&mut y);
        Ok(y)
    }

    fn cat_rows(&self, parts: &[(&Tensor, std::ops::Range<usize>)]) -> Result<Tensor> {
        let (shape, w) = super::cat_shape(parts)?;
        let mut data = Vec::with_capacity(shape.iter().product());
        for (t, r) in parts {
            data.extend_from_slice(&t.data[r.start * w..r.end * w]);
        }
        Ok(Tensor::new(shape, data))
    }

    fn kv_cache_fp8(&self, x: &Tensor, nope: usize, group: usize) -> Result<Tensor> {
        let cols = x.cols();
        if nope > cols || group == 0 {
            return Err(Error::usage(format!(
                "kv cache: {nope} quantized dims of rows of {cols} in groups of {group}"
            )));
        }
        let y =
            crate::numerics::fp8_block::fake_quant_kv_cache(&x.data, x.rows(), cols, nope, group);
        Ok(Tensor::new(x.shape.clone(), y))
    }

    fn slice_cols(&self, x: &Tensor, c0: usize, w: usize) -> Result<Tensor> {
        let cols = x.cols();
        if c0 + w > cols {
            return Err(Error::usage(format!(
                "columns {c0}..{} of rows of {cols}",
                c0 + w
            )));
        }
        Ok(Tensor::new(
            vec![x.rows(), w],
            family::slice_cols(&x.data, cols, c0, w),
        ))
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
        let mut y = Tensor::new(
            vec![dims.t, dims.h * dims.dv],
            family::gqa_core(&q.data, &k.data, &v.data, sinks, dims),
        );
        (self.store)(&mut y);
        Ok(y)
    }

    fn mla_keys(&self, kvb: &Tensor, kva: &Tensor, d: MlaDims) -> Result<(Tensor, Tensor)> {
        mla_sizes(kvb, kva, d)?;
        let (k, v) = family::mla_keys(&kvb.data, &kva.data, d);
        Ok((
            Tensor::new(vec![d.t, d.h * (d.nope + d.rope)], k),
            Tensor::new(vec![d.t, d.h * d.dv], v),
        ))
    }

    fn glu_oss(&self, gu: GluIn<'_>, limit: f32) -> Result<Tensor> {
        let (n, i) = gu.dims()?;
        let h = match gu {
            GluIn::Interleaved(gu) => family::glu_rows(&gu.data, limit),
            GluIn::Split(g, u) => family::glu_pairs(&g.data, &u.data, 1, n * i, limit),
        };
        let mut h = Tensor::new(vec![n, i], h);
        (self.store)(&mut h);
        Ok(h)
    }
}

/// The error of a grouped-query attention whose inputs do not match its dims (every device's).
pub fn gqa_sizes(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    sinks: Option<&[f32]>,
    dims: GqaDims,
) -> Error {
    Error::usage(format!(
        "grouped-query attention of q {:?}, k {:?}, v {:?}, sinks {:?} for {dims:?}",
        q.shape,
        k.shape,
        v.shape,
        sinks.map(<[f32]>::len)
    ))
}

/// MLA's key gather: `kv_b` and `kv_a` of the sizes `d` asks for (every device's check).
pub fn mla_sizes(kvb: &Tensor, kva: &Tensor, d: MlaDims) -> Result<()> {
    if kvb.numel() != d.t * d.h * (d.nope + d.dv) || kva.numel() != d.t * (d.lora + d.rope) {
        return Err(Error::usage(format!(
            "MLA keys from kv_b {:?} and kv_a {:?} for {d:?}",
            kvb.shape, kva.shape
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ops::RopeTable;

    fn vals(seed: u32, n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| {
                (((i as u32 ^ seed).wrapping_mul(2654435761) >> 8) % 2000) as f32 / 1000.0 - 0.999
            })
            .collect()
    }

    fn dev() -> CpuDevice<impl Fn(&mut Tensor)> {
        CpuDevice::new(|t: &mut Tensor| t.round_bf16())
    }

    /// A row of three heads is rotated head by head at the row's position, as three rows of one
    /// head each would be with the position repeated.
    #[test]
    fn rope_rotates_every_head_of_a_row() {
        let (t, k, dh, nope) = (5usize, 3usize, 8usize, 4usize);
        let x = vals(3, t * k * dh);
        let tab = RopeTable::new(&[0.5, 0.01], 0..t);
        let got = dev()
            .rope(&Tensor::new(vec![t, k * dh], x.clone()), dh, nope, &tab)
            .unwrap();
        let rep = RopeTable::new(&[0.5, 0.01], (0..t).flat_map(|p| [p; 3]));
        let want = dev()
            .rope(&Tensor::new(vec![t * k, dh], x.clone()), dh, nope, &rep)
            .unwrap();
        assert_eq!(got.data, want.data);
        assert_ne!(
            got.data,
            Tensor::new(vec![t, k * dh], x).rounded_bf16().data
        );
        let bad = dev().rope(&Tensor::new(vec![2, 12], vals(1, 24)), 8, 4, &tab);
        assert_eq!(bad.unwrap_err().exit_code(), 2);
    }

    /// The op in chunks of any size gives one call's bits; a raw selection (unsorted, repeats)
    /// reads as its sorted lists; a bad entry and a block of a prompt are refused.
    #[test]
    fn attention_in_chunks_is_one_call_and_checks_its_selection() {
        let (t, h, dh, win, nope, kk, ratio) =
            (29usize, 2usize, 8usize, 5usize, 4usize, 3usize, 4usize);
        let n_c = t / ratio;
        let q = Tensor::new(vec![t, h * dh], vals(1, t * h * dh));
        let kv = Tensor::new(vec![t, dh], vals(2, t * dh));
        let cmp = Tensor::new(vec![n_c, dh], vals(3, n_c * dh));
        let raw: Vec<f32> = (0..t * kk)
            .map(|i| [5.0, -1.0, 2.0, 5.0, 0.0, 6.0][i % 6])
            .collect();
        let sorted = kern::selection_lists(&raw, kk, n_c);
        let sorted: Vec<f32> = sorted.iter().map(|&v| v as f32).collect();
        let dims = AttnDims {
            t,
            h,
            dh,
            n_c,
            win,
            scale: 0.3,
            q0: 0,
            kv0: 0,
        };
        let tab = RopeTable::new(&[0.5, 0.01], 0..t);
        let sink = [0.2f32, -0.1];
        let run = |sel: &[f32], chunk: usize, d: AttnDims| {
            let s = Tensor::new(vec![t, kk], sel.to_vec());
            let keys = CmpRows {
                ratio,
                sel: Some(&s),
            };
            dev().attention(&q, &kv, &cmp, keys, &sink, d, nope, &tab, chunk)
        };
        let whole = run(&sorted, t, dims).unwrap();
        for chunk in [1usize, 4, 7, t + 3] {
            assert_eq!(
                run(&raw, chunk, dims).unwrap().data,
                whole.data,
                "chunk {chunk}"
            );
        }
        let mut bad = raw.clone();
        bad[10] = 2.5;
        let e = run(&bad, 7, dims).unwrap_err().to_string();
        assert!(e.contains("indexer entry 2.5"), "{e}");
        let block = AttnDims {
            q0: 4,
            kv0: 0,
            ..dims
        };
        assert!(run(&raw, 7, block).is_err());
    }
}
