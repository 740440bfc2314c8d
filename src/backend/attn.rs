//! The attention op and the indexer's selection on the device (`kernels/layer.cu`), the two ops
//! whose work grows with the prompt: the attention over the whole prompt in query chunks that run
//! in place in one output, its key lists made on the device from the indexer's selection
//! (`sel_lists`), and the indexer's scores and top-k in query blocks of bounded size
//! (`indexer_scores`, `indexer_topk`); and the model families' grouped-query attention
//! (`gqa_attn`, scores a tile of keys at a time) with MLA's key gather (`mla_kv`). Each computes
//! what `device::kern` / `device::family` computes, bit for bit, and reads back nothing per
//! chunk or block; `CudaDevice` (`layer.rs`) calls them.

use cudarc::driver::LaunchConfig;

use super::cuda::Gpu;
use crate::device::family::{GqaDims, MlaDims};
use crate::device::kern::{self, AttnDims, CmpKeys, IndexerDims};
use crate::device::ops::RopeTable;
use crate::tensor::Data;
use crate::{Error, Result};

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

/// Keys per CUDA block of `attn_gather` (`ATTN_GATHER_KEYS` in kernels/layer.cu).
const ATTN_GATHER_KEYS: usize = 16;

/// Keys per tile of `gqa_attn`'s scores in shared memory (`GQA_TILE` in kernels/layer.cu).
const GQA_TILE: usize = 1024;

/// Threads of one `gqa_attn` block (a multiple of 32).
const GQA_THREADS: u32 = 128;

/// Most `gqa_attn` blocks per launch (the kernel strides over the (query, head) tasks).
const GQA_MAX_BLOCKS: usize = 1 << 20;

/// The dynamic shared memory of `gqa_attn` for values of width dv (32 doubles, the dv f64 sums,
/// a tile of scores), None when it exceeds [`SMEM_DEFAULT`].
fn gqa_smem(dv: usize) -> Option<usize> {
    let smem = 32 * 8 + dv * 8 + GQA_TILE * 4;
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

    /// The attention core of the queries of `a` as attn_core computes it, on the FP64 tensor
    /// cores: per block of queries ([`kern::attn_blas_block`]) their keys gathered and widened
    /// (`attn_gather`), the scores of every head as one batched DGEMM (queries as the batch,
    /// [h, dh] · [keys, dh]ᵀ), attn_core's softmax per (query, head) row (`attn_softmax`), the
    /// outputs as a second batched DGEMM ([h, keys] · [keys, dh]), rounded once to f32. The
    /// products are exact and the sums f64, as in attn_core, so the f32 results are the same.
    fn attn_blas_launch(&mut self, l: &AttnLaunch, a: AttnDims) -> Result<()> {
        let (h, dh, mk) = (a.h, a.dh, l.max_keys);
        if a.t == 0 || h == 0 {
            return Ok(());
        }
        let hd = h * dh;
        let bq = kern::attn_blas_block(h, dh, mk).min(a.t);
        let kg = self.scratch("attn_kg", bq * mk * dh.max(1) * 8)?;
        let sd = self.scratch("attn_s", bq * h * mk.max(1) * 8)?;
        let pd = self.scratch("attn_p", bq * h * mk.max(1) * 8)?;
        let qd = self.scratch("attn_q", bq * hd.max(1) * 8)?;
        let od = self.scratch("attn_o", bq * hd.max(1) * 8)?;
        let nk = self.scratch("attn_nk", bq * 4)?;
        let smem = (mk.max(1) * 4) as u32;
        for (b0, b1) in kern::chunks(a.t, bq) {
            let part = a.sub(b0, b1);
            let rows = b1 - b0;
            let kv = row_at(l.kv, part.kv0 - a.kv0, dh);
            let sel = if l.kk > 0 {
                row_at(l.sel, b0, l.kk)
            } else {
                l.sel
            };
            self.kern().attn_gather(
                LaunchConfig {
                    grid_dim: (rows as u32, mk.div_ceil(ATTN_GATHER_KEYS).max(1) as u32, 1),
                    block_dim: (256, 1, 1),
                    shared_mem_bytes: 0,
                },
                kv,
                l.cmp,
                sel,
                l.kk as u64,
                l.has_sel as i32,
                l.ratio as u64,
                rows as u64,
                dh as u64,
                part.n_c as u64,
                part.win as u64,
                mk as u64,
                part.q0 as u64,
                part.kv0 as u64,
                nk,
                kg,
            )?;
            self.widen(row_at(l.q, b0, hd), 0, rows, hd, hd, qd)?;
            if mk > 0 && dh > 0 {
                // scores: column-major Sᵀ[keys, h] = Kg[dh, keys]ᵀ · Qᵀ[dh, h] per query
                self.dgemm_batched(
                    (true, false),
                    (mk, h, dh),
                    (kg, dh, mk * dh),
                    (qd, dh, hd),
                    (sd, mk, h * mk),
                    rows,
                )?;
            }
            self.kern().attn_softmax(
                LaunchConfig {
                    grid_dim: ((rows * h) as u32, 1, 1),
                    block_dim: (128, 1, 1),
                    shared_mem_bytes: smem,
                },
                sd,
                nk,
                l.sink,
                (rows * h) as u64,
                h as u64,
                mk as u64,
                a.scale,
                pd,
            )?;
            if mk > 0 && dh > 0 {
                // outputs: column-major Oᵀ[dh, h] = Kg[dh, keys] · Pᵀ[keys, h] per query
                self.dgemm_batched(
                    (false, false),
                    (dh, h, mk),
                    (kg, dh, mk * dh),
                    (pd, mk, h * mk),
                    (od, dh, hd),
                    rows,
                )?;
            } else {
                self.memset(od, 0, rows * hd * 8)?;
            }
            self.narrow(od, rows, hd, hd, row_at(l.out, b0, hd))?;
        }
        Ok(())
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
        if q.len() != t * hd
            || !a.kv_covers()
            || kv.len() != (a.q0 + t - a.kv0) * dh
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
            let part = a.sub(q0, q1);
            let l = AttnLaunch {
                q: row_at(qb.ptr, q0, hd),
                kv: row_at(kb.ptr, part.kv0 - a.kv0, dh),
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
            if self.attn_blas {
                self.attn_blas_launch(&l, part)?;
            } else {
                self.attn_core_launch(&l, part)?;
            }
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
                    super::layer::ROPE_INVERSE,
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

    /// The model families' causal grouped-query attention (`device::family::gqa_core`, the
    /// path's rounding) of q [t, h·dq] over k [q0 + t, kvh·dq], v [q0 + t, kvh·dv] with the heads' sink
    /// logits, if any: one launch over every (query, head), each block holding one tile of its
    /// query's scores (never [t, t]). None when values of width dv do not fit the kernel's shared
    /// memory (the caller computes the op on the host).
    pub fn gqa(
        &mut self,
        q: &Data,
        k: &Data,
        v: &Data,
        sinks: Option<&[f32]>,
        a: GqaDims,
        round: bool,
    ) -> Result<Option<Data>> {
        let Some(smem) = gqa_smem(a.dv) else {
            return Ok(None);
        };
        if !a.fits(q.len(), k.len(), v.len(), sinks.map(<[f32]>::len)) {
            return Err(Error::Backend(format!(
                "cuda: grouped-query attention of q {}, k {}, v {}, sinks {:?} for {a:?}",
                q.len(),
                k.len(),
                v.len(),
                sinks.map(<[f32]>::len)
            )));
        }
        let n = a.t * a.h;
        let ob = self.out(n * a.dv * 4)?;
        if n == 0 || a.dv == 0 {
            return Ok(Some(self.output(ob, n * a.dv, round)));
        }
        let (qb, kb, vb) = (self.input(q)?, self.input(k)?, self.input(v)?);
        let sb = self.upload(sinks.unwrap_or(&[0.0]))?;
        // keys per query: the window, or every earlier key (q0 + t covers them all)
        let win = a.window.unwrap_or(a.q0 + a.t);
        let cfg = LaunchConfig {
            grid_dim: (n.min(GQA_MAX_BLOCKS) as u32, 1, 1),
            block_dim: (GQA_THREADS, 1, 1),
            shared_mem_bytes: smem as u32,
        };
        self.kern().gqa_attn(
            cfg,
            qb.ptr,
            kb.ptr,
            vb.ptr,
            sb.ptr,
            sinks.is_some() as i32,
            a.t as u64,
            a.q0 as u64,
            a.h as u64,
            a.kvh as u64,
            a.dq as u64,
            a.dv as u64,
            win as u64,
            a.scale,
            round as i32,
            ob.ptr,
        )?;
        Ok(Some(self.output(ob, n * a.dv, round)))
    }

    /// MLA's keys [t, h·(nope + rope)] and values [t, h·dv] gathered on the device from `kv_b`
    /// and `kv_a` (`device::family::mla_keys`; a copy).
    pub fn mla_keys(&mut self, kvb: &Data, kva: &Data, d: MlaDims) -> Result<(Data, Data)> {
        let MlaDims {
            t,
            h,
            nope,
            rope,
            dv,
            lora,
        } = d;
        if kvb.len() != t * h * (nope + dv) || kva.len() != t * (lora + rope) {
            return Err(Error::Backend(format!(
                "cuda: MLA keys from kv_b {} and kv_a {} for {d:?}",
                kvb.len(),
                kva.len()
            )));
        }
        let (nk, nv) = (t * h * (nope + rope), t * h * dv);
        let (bb, ab) = (self.input(kvb)?, self.input(kva)?);
        let (kb, vb) = (self.out(nk * 4)?, self.out(nv * 4)?);
        self.kern().mla_kv(
            (nk + nv) as u64,
            bb.ptr,
            ab.ptr,
            t as u64,
            h as u64,
            nope as u64,
            rope as u64,
            dv as u64,
            lora as u64,
            kb.ptr,
            vb.ptr,
        )?;
        let exact = kvb.known_bf16_exact() == Some(true) && kva.known_bf16_exact() == Some(true);
        Ok((self.output(kb, nk, exact), self.output(vb, nv, exact)))
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
            q0,
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
        // the keys widened to f64 once, for the batched DGEMM scores
        let kd = if self.attn_blas && m_max > kk {
            let kd = self.scratch("idx_k", m_max * di.max(1) * 8)?;
            self.widen(kb.ptr, 0, m_max, di, di, kd)?;
            Some(kd)
        } else {
            None
        };
        for (t0, t1) in kern::chunks(t, rows) {
            let (nq, m_b) = (t1 - t0, d.causal(t1 - 1));
            if let (Some(kd), true) = (kd, m_b > kk) {
                let q = row_at(qb.ptr, t0, hi * di);
                let w = row_at(wb.ptr, t0, hi);
                self.indexer_blas(q, kd, w, (nq, hi, di, m_b), sb.ptr)?;
            } else if m_b > kk {
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
            // the kernel takes the query's position (q0 + t0 + i) and writes that row of its
            // output: the output's base is moved back by q0 rows, which it never touches
            let base = ob.ptr.wrapping_sub((q0 * kk * 4) as u64);
            self.topk_launch(sb.ptr, nq, m_b, q0 + t0, ratio, n_c, kk, base)?;
        }
        Ok(self.output(ob, t * kk, false))
    }

    /// `indexer_scores` of `nq` queries against the first `m` keys, the dot products as DGEMMs:
    /// per sub-block of queries (at most [`kern::BLAS_BLOCK_BYTES`] of f64 products) q [nq·hi, di]
    /// widened, times the f64 keys `kd` [m, di]ᵀ, then `indexer_reduce` (relu, f32, weighted sum
    /// over the heads in order) into scores [nq, m] at `out`.
    fn indexer_blas(
        &mut self,
        q: u64,
        kd: u64,
        w: u64,
        (nq, hi, di, m): (usize, usize, usize, usize),
        out: u64,
    ) -> Result<()> {
        if nq == 0 || m == 0 || hi == 0 {
            return Ok(());
        }
        let ns = (kern::BLAS_BLOCK_BYTES / (hi * m * 8).max(1)).clamp(1, nq);
        let qd = self.scratch("idx_q", ns * hi * di.max(1) * 8)?;
        let sd = self.scratch("idx_s", ns * hi * m * 8)?;
        for (a, b) in kern::chunks(nq, ns) {
            let r = (b - a) * hi;
            self.widen(row_at(q, a, hi * di), 0, r, di, di, qd)?;
            if di == 0 {
                self.memset(sd, 0, r * m * 8)?;
            } else {
                self.timed("cuBLAS DGEMM", || self.dgemm(qd, kd, sd, r, m, di))?;
            }
            self.kern().indexer_reduce(
                ((b - a) * m) as u64,
                sd,
                row_at(w, a, hi),
                (b - a) as u64,
                hi as u64,
                m as u64,
                m as u64,
                row_at(out, a, m),
            )?;
        }
        Ok(())
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
            self.topk_launch(sb.ptr, rows, ld, t0, ratio, n_c, kk, ob.ptr)?;
        }
        let all: Vec<f32> = self.download(ob.ptr, (t0 + rows) * kk)?;
        Ok(all[t0 * kk..].to_vec())
    }

    /// One `indexer_topk` launch: query i of `nq` (at position t0 + i) selects its top `kk` of
    /// its causal rows of scores [nq, ld] into rows t0.. of the selection; one block per query.
    #[allow(clippy::too_many_arguments)]
    fn topk_launch(
        &self,
        scores: u64,
        nq: usize,
        ld: usize,
        t0: usize,
        ratio: usize,
        n_c: usize,
        kk: usize,
        out: u64,
    ) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (nq as u32, 1, 1),
            block_dim: (TOPK_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        self.kern().indexer_topk(
            cfg,
            scores,
            nq as u64,
            ld as u64,
            t0 as u64,
            ratio as u64,
            n_c as u64,
            kk as u64,
            out,
        )
    }
}
