//! The host ops' numerics as plain functions over slices: one definition per op, which the CPU
//! backend runs and the CUDA backend reproduces in `kernels/layer.cu` (`backend::layer`), bit for
//! bit. `selftest --backend cuda` compares every one of them on fresh random data.
//!
//! What makes the two backends agree whatever order a device reduction takes: every reduction
//! (RMS, dot products, softmax denominators, weighted sums over keys) accumulates exact f32
//! products in f64 and rounds once to f32; every transcendental (exp, sigmoid, softplus) is
//! evaluated in f64 and rounded once. Two f64 sums of the same terms in different orders differ
//! by a few f64 ulps, which changes the rounded f32 only when the sum sits within those ulps of an
//! f32 rounding boundary (about one case in 2^28). Short sequential f32 chains (the mHC stream
//! sums, Sinkhorn's 4×4 normalisation, the routing weights) are written in one fixed order that
//! the device repeats. RoPE tables are computed on the host and uploaded.

use rayon::prelude::*;

/// exp evaluated in f64 (CUDA's and libm's f32 `exp` differ in the last bit; their f64 results
/// round to the same f32).
#[inline]
pub fn exp64(x: f32) -> f64 {
    (x as f64).exp()
}

/// 1 / (1 + e^−x), evaluated in f64 and rounded once.
#[inline]
pub fn sigmoid(x: f32) -> f32 {
    (1.0 / (1.0 + (-(x as f64)).exp())) as f32
}

/// softplus without overflow, max(x, 0) + ln(1 + e^−|x|), evaluated in f64 and rounded once.
#[inline]
pub fn softplus(x: f32) -> f32 {
    let d = x as f64;
    (d.max(0.0) + (-d.abs()).exp().ln_1p()) as f32
}

/// Exact f32 products summed in f64.
#[inline]
pub fn dot64(a: &[f32], b: &[f32]) -> f64 {
    sum64(a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64))
}

/// f64 sum starting from +0 (the start the device uses; std's `Sum` may start from −0).
#[inline]
pub fn sum64(v: impl Iterator<Item = f64>) -> f64 {
    v.fold(0.0f64, |a, b| a + b)
}

/// In-place softmax; −inf entries get 0; an all −inf (or all NaN) row becomes all zeros.
/// e_i = exp(x_i − max) in f64, p_i = e_i / Σe in f64, rounded once.
pub fn softmax(row: &mut [f32]) {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    if m == f32::NEG_INFINITY {
        row.iter_mut().for_each(|v| *v = 0.0);
        return;
    }
    let s = sum64(row.iter().map(|&v| exp64(v - m)));
    row.iter_mut().for_each(|v| *v = (exp64(*v - m) / s) as f32);
}

/// rsqrt(mean(x²) + eps) of a row: the sum of squares in f64, rounded once.
#[inline]
pub fn rms_inv(row: &[f32], eps: f32) -> f32 {
    let ss = dot64(row, row);
    (1.0 / (ss / row.len() as f64 + eps as f64).sqrt()) as f32
}

/// f32 sum in index order starting from +0 (the order the device repeats).
#[inline]
pub fn sum_f32(v: impl Iterator<Item = f32>) -> f32 {
    v.fold(0.0f32, |a, b| a + b)
}

/// mHC Sinkhorn normalisation of an `n`×`n` matrix of logits `c` (row j = source stream), in place
/// (docs/DSV4-LAYER.md §3.1 step 5): row softmax + eps, column normalisation, then `iters − 1` rounds
/// of row then column normalisation, each dividing by (sum + eps).
pub fn sinkhorn(c: &mut [f32], n: usize, iters: usize, eps: f32) {
    for row in c.chunks_mut(n) {
        softmax(row);
        row.iter_mut().for_each(|v| *v += eps);
    }
    let colnorm = |c: &mut [f32]| {
        for k in 0..n {
            let s = sum_f32((0..n).map(|j| c[j * n + k]));
            (0..n).for_each(|j| c[j * n + k] /= s + eps);
        }
    };
    colnorm(c);
    for _ in 1..iters.max(1) {
        for row in c.chunks_mut(n) {
            let s = sum_f32(row.iter().copied());
            row.iter_mut().for_each(|v| *v /= s + eps);
        }
        colnorm(c);
    }
}

/// The mHC parameters the mixing op needs, per layer.
#[derive(Clone, Copy, Debug)]
pub struct HcParams<'a> {
    pub hc: usize,
    /// [3]: pre, post, comb scales.
    pub scale: &'a [f32],
    /// [2·hc + hc²].
    pub base: &'a [f32],
    pub iters: usize,
    /// hc_eps.
    pub eps: f32,
}

/// One token's mHC coefficients from its mixing row `mr` (already multiplied by ρ): pre [hc],
/// post [hc], comb [hc·hc] (Sinkhorn-normalised).
pub fn hc_coeffs(mr: &[f32], p: &HcParams, pre: &mut [f32], post: &mut [f32], comb: &mut [f32]) {
    let hc = p.hc;
    for j in 0..hc {
        pre[j] = sigmoid(mr[j] * p.scale[0] + p.base[j]) + p.eps;
        post[j] = 2.0 * sigmoid(mr[hc + j] * p.scale[1] + p.base[hc + j]);
    }
    for (i, cv) in comb.iter_mut().enumerate() {
        *cv = mr[2 * hc + i] * p.scale[2] + p.base[2 * hc + i];
    }
    sinkhorn(comb, hc, p.iters, p.eps);
}

/// [`hc_coeffs`] of every token: `m` [t, 2·hc + hc²] mixing rows → (pre [t, hc], post [t, hc],
/// comb [t, hc·hc]).
pub fn hc_coeffs_rows(m: &[f32], p: &HcParams, t: usize) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let hc = p.hc;
    let mix = 2 * hc + hc * hc;
    let (mut pre, mut post, mut comb) = (
        vec![0f32; t * hc],
        vec![0f32; t * hc],
        vec![0f32; t * hc * hc],
    );
    for ti in 0..t {
        hc_coeffs(
            &m[ti * mix..(ti + 1) * mix],
            p,
            &mut pre[ti * hc..(ti + 1) * hc],
            &mut post[ti * hc..(ti + 1) * hc],
            &mut comb[ti * hc * hc..(ti + 1) * hc * hc],
        );
    }
    (pre, post, comb)
}

/// Scale each mixing row by its stream's ρ = rsqrt(mean(x²) + eps) over the token's hc·d values.
pub fn hc_scale_rows(m: &mut [f32], x: &[f32], t: usize, rows_out: usize, eps: f32) {
    let w = x.len() / t.max(1);
    for (xr, mr) in x.chunks(w).zip(m.chunks_mut(rows_out)) {
        let rho = rms_inv(xr, eps);
        mr.iter_mut().for_each(|v| *v *= rho);
    }
}

/// y[t, d] = Σ_j coef[t, j] · x[t, j, :] over the hc streams, in stream order from +0.
pub fn hc_weighted_sum(x: &[f32], coef: &[f32], t: usize, hc: usize, d: usize) -> Vec<f32> {
    let mut y = vec![0.0f32; t * d];
    y.par_chunks_mut(d.max(1)).enumerate().for_each(|(ti, yr)| {
        for j in 0..hc {
            let pj = coef[ti * hc + j];
            let xr = &x[(ti * hc + j) * d..(ti * hc + j + 1) * d];
            yr.iter_mut().zip(xr).for_each(|(a, b)| *a += pj * b);
        }
    });
    y
}

/// mHC post: out[t, k, :] = post[t, k] · y[t, :] + Σ_j comb[t, j, k] · x[t, j, :].
pub fn hc_post(
    y: &[f32],
    x: &[f32],
    post: &[f32],
    comb: &[f32],
    t: usize,
    hc: usize,
    d: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; t * hc * d];
    out.par_chunks_mut((hc * d).max(1))
        .enumerate()
        .for_each(|(ti, o)| {
            let yr = &y[ti * d..(ti + 1) * d];
            let c = &comb[ti * hc * hc..(ti + 1) * hc * hc];
            for k in 0..hc {
                let ok = &mut o[k * d..(k + 1) * d];
                let pk = post[ti * hc + k];
                ok.iter_mut().zip(yr).for_each(|(a, b)| *a = pk * b);
                for j in 0..hc {
                    let cjk = c[j * hc + k];
                    let xr = &x[(ti * hc + j) * d..(ti * hc + j + 1) * d];
                    ok.iter_mut().zip(xr).for_each(|(a, b)| *a += cjk * b);
                }
            }
        });
    out
}

/// Shapes and constants of the attention core.
#[derive(Clone, Copy, Debug)]
pub struct AttnDims {
    /// Queries (rows of q).
    pub t: usize,
    pub h: usize,
    pub dh: usize,
    /// Compressed rows (0 on window-only layers), always counted from the prompt's start.
    pub n_c: usize,
    pub win: usize,
    pub scale: f32,
    /// Position of the first query in the prompt (0 unless the queries are a later chunk).
    pub q0: usize,
    /// Position of kv's first row: kv holds the rows [kv0, q0 + t), which must cover every
    /// query's window (kv0 ≤ max(0, q0 + 1 − win)).
    pub kv0: usize,
}

impl AttnDims {
    /// Keys the call's queries attend to, summed (the work of the attention's two products is
    /// 4 · h · dh per key): each query's window rows, then its causal compressed rows (ratio > 0)
    /// or at most `kk` of them (the indexer's selection, `kk` = Some).
    pub fn keys(&self, ratio: usize, kk: Option<usize>) -> u64 {
        (0..self.t)
            .map(|i| {
                let p = self.q0 + i;
                let win = (p + 1).min(self.win);
                let cmp = match ratio {
                    0 => 0,
                    r => ((p + 1) / r).min(self.n_c),
                };
                (win + kk.map_or(cmp, |k| cmp.min(k))) as u64
            })
            .sum()
    }

    /// The dims of the queries [a, b) of this call's queries (local indices; positions
    /// q0 + a .. q0 + b): their kv rows start at the first one's window, never before this
    /// call's kv0 (every later query's window starts no earlier), so the part's keys, their
    /// order and its results are those of the same queries in one call. The part's kv rows are
    /// this call's from row `part.kv0 − kv0`.
    pub fn sub(&self, a: usize, b: usize) -> AttnDims {
        let q0 = self.q0 + a;
        AttnDims {
            t: b - a,
            q0,
            kv0: (q0 + 1).saturating_sub(self.win).min(q0).max(self.kv0),
            ..*self
        }
    }

    /// Whether kv rows from kv0 cover every query's window (kv0 ≤ max(0, q0 + 1 − win), or
    /// kv0 ≤ q0 without a window).
    pub fn kv_covers(&self) -> bool {
        self.kv0 <= (self.q0 + 1).saturating_sub(self.win).min(self.q0)
    }

    /// The window of the query at position p: kv positions [lo, p] (empty when win = 0).
    #[inline]
    pub fn window(&self, p: usize) -> std::ops::Range<usize> {
        if self.win == 0 {
            return p..p;
        }
        (p + 1).saturating_sub(self.win)..p + 1
    }
}

/// Which compressed rows each query sees, described per query instead of as a [t, n_c] mask:
/// the causal count min((p + 1) / ratio, n_c) of the query at position p, and, where the
/// indexer selects, its selection list ([t, kk] row indices, ascending, −1 padding after the
/// last): the rows of the list below the causal count, in list order.
#[derive(Clone, Copy, Debug)]
pub struct CmpKeys<'a> {
    /// The layer's compression ratio (0: no compressed rows).
    pub ratio: usize,
    /// The per-query selection lists and their width kk.
    pub sel: Option<(&'a [i32], usize)>,
}

impl CmpKeys<'_> {
    /// No compressed rows (window-only layers).
    pub const NONE: CmpKeys<'static> = CmpKeys {
        ratio: 0,
        sel: None,
    };

    /// The causal count of compressed rows of the query at position p.
    #[inline]
    pub fn causal(&self, p: usize, n_c: usize) -> usize {
        if self.ratio == 0 {
            return 0;
        }
        ((p + 1) / self.ratio).min(n_c)
    }

    /// The compressed rows of query `i` (position `p`), in the order the core sums them.
    pub fn rows(&self, i: usize, p: usize, n_c: usize) -> impl Iterator<Item = usize> + '_ {
        let m = self.causal(p, n_c);
        let (list, all) = match self.sel {
            Some((s, kk)) => (&s[i * kk..(i + 1) * kk], 0),
            None => (&[][..], m),
        };
        list.iter()
            .take_while(|&&v| v >= 0)
            .map(|&v| v as usize)
            .filter(move |&v| v < m)
            .chain(0..all)
    }

    /// The most compressed keys any query can have (sizes the device kernel's key list).
    pub fn max_rows(&self, n_c: usize) -> usize {
        match self.sel {
            _ if self.ratio == 0 => 0,
            Some((_, kk)) => kk.min(n_c),
            None => n_c,
        }
    }
}

/// The first entry of the indexer's selection that is neither −1 nor a compressed row index
/// (an integer in [0, n_c)): the attention refuses such a selection on every device.
pub fn selection_error(sel: &[f32], n_c: usize) -> Option<f32> {
    sel.iter()
        .copied()
        .find(|&v| v != -1.0 && !(v >= 0.0 && v.fract() == 0.0 && (v as usize) < n_c))
}

/// The message of a [`selection_error`] (the same on every device).
pub fn selection_error_msg(v: f32, n_c: usize) -> String {
    format!("indexer entry {v} is neither −1 nor a row < {n_c}")
}

/// The query chunks [q0, q1) of t queries, `chunk` at a time (at least one).
pub fn chunks(t: usize, chunk: usize) -> impl Iterator<Item = (usize, usize)> {
    let c = chunk.max(1);
    (0..t.div_ceil(c)).map(move |i| (i * c, ((i + 1) * c).min(t)))
}

/// The indexer's selection [t, kk] (f32, −1 = none) as the attention's per-query lists: each
/// query's valid entries (a row < n_c) sorted ascending without repeats, −1 after them.
/// O(t·kk): never a [t, n_c] mask.
pub fn selection_lists(sel: &[f32], kk: usize, n_c: usize) -> Vec<i32> {
    let mut out = vec![-1i32; sel.len()];
    if kk == 0 {
        return out;
    }
    out.par_chunks_mut(kk)
        .zip(sel.par_chunks(kk))
        .for_each(|(o, s)| {
            let mut v: Vec<i32> = s
                .iter()
                .filter(|&&x| x >= 0.0 && (x as usize) < n_c)
                .map(|&x| x as i32)
                .collect();
            v.sort_unstable();
            v.dedup();
            o[..v.len()].copy_from_slice(&v);
        });
    out
}

/// MQA over one latent row per key (K = V): for query i (position p = q0 + i) and head, the
/// keys are the window [p − win + 1, p] of `kv` (whose row 0 is position kv0), then the
/// compressed rows of `keys` (ascending), plus the head's sink logit. Scores = f32(q·k in
/// f64) · scale; softmax with f64 exp and denominator, probabilities rounded to f32; output =
/// Σ p·k in f64, rounded once. Returns [t, h·dh] before the path's storage rounding.
pub fn attention_core(
    q: &[f32],
    kv: &[f32],
    cmp: &[f32],
    keys: CmpKeys,
    sink: &[f32],
    a: AttnDims,
) -> Vec<f32> {
    let AttnDims {
        t,
        h,
        dh,
        n_c,
        scale,
        q0,
        kv0,
        ..
    } = a;
    let mut out = vec![0.0f32; t * h * dh];
    out.par_chunks_mut(dh.max(1))
        .enumerate()
        .for_each(|(task, o)| {
            let (ti, head) = (task / h, task % h);
            let p = q0 + ti;
            let qv = &q[(ti * h + head) * dh..(ti * h + head + 1) * dh];
            let mut kr: Vec<&[f32]> = a
                .window(p)
                .map(|k| &kv[(k - kv0) * dh..(k - kv0 + 1) * dh])
                .collect();
            kr.extend(keys.rows(ti, p, n_c).map(|j| &cmp[j * dh..(j + 1) * dh]));
            let s: Vec<f32> = kr.iter().map(|k| (dot64(qv, k) as f32) * scale).collect();
            let sk = sink[head];
            let mx = s.iter().cloned().fold(sk, f32::max);
            let den = exp64(sk - mx) + sum64(s.iter().map(|&v| exp64(v - mx)));
            let mut acc = vec![0.0f64; dh];
            for (k, &v) in kr.iter().zip(&s) {
                let p = (exp64(v - mx) / den) as f32 as f64;
                acc.iter_mut()
                    .zip(k.iter())
                    .for_each(|(a, &x)| *a += p * x as f64);
            }
            o.iter_mut().zip(&acc).for_each(|(o, a)| *o = *a as f32);
        });
    out
}

/// The compressor's gated softmax pooling (docs/DSV4-LAYER.md §3.5.1), before any rounding: for block
/// b and channel ch the slots are the previous block's tokens through channels [0, dc) (ratio 4:
/// two overlapping windows, c = 2; empty for b = 0) then this block's tokens through channels
/// [c·dc − dc, c·dc); gate = g + ape, softmax over the slots, value = Σ p·a in f64.
/// `a`, `g` [n_c·ratio, c·dc], `ape` [ratio, c·dc] → [n_c, dc].
pub fn compress_pool(
    a: &[f32],
    g: &[f32],
    ape: &[f32],
    n_c: usize,
    dc: usize,
    ratio: usize,
) -> Vec<f32> {
    let c = if ratio == 4 { 2 } else { 1 };
    let w = c * dc;
    let mut out = vec![0.0f32; n_c * dc];
    out.par_chunks_mut(dc.max(1))
        .enumerate()
        .for_each(|(b, o)| {
            let mut gates = Vec::with_capacity(2 * ratio);
            let mut vals = Vec::with_capacity(2 * ratio);
            for (ch, ov) in o.iter_mut().enumerate() {
                gates.clear();
                vals.clear();
                let off = (c - 1) * dc;
                if c == 2 && b > 0 {
                    for j in 0..ratio {
                        let tok = (b - 1) * ratio + j;
                        gates.push(g[tok * w + ch] + ape[j * w + ch]);
                        vals.push(a[tok * w + ch]);
                    }
                }
                for j in 0..ratio {
                    let tok = b * ratio + j;
                    gates.push(g[tok * w + off + ch] + ape[j * w + off + ch]);
                    vals.push(a[tok * w + off + ch]);
                }
                softmax(&mut gates);
                *ov = dot64(&gates, &vals) as f32;
            }
        });
    out
}

/// The most bytes of indexer scores held at once: the queries are scored and selected in
/// blocks of rows, so the indexer's memory is O(block·n_c), never O(t·n_c).
const SCORE_BLOCK_BYTES: usize = 64 << 20;

/// The most bytes of f64 work a device's batched-DGEMM attention or indexer scoring holds for
/// one block of queries (gathered keys, scores, probabilities; the indexer's per-head products).
pub const BLAS_BLOCK_BYTES: usize = 192 << 20;

/// Queries per block of a device's batched-DGEMM attention for `max_keys` keys per query: as
/// many as fit [`BLAS_BLOCK_BYTES`] (gathered f64 keys, f64 scores and probabilities, f64
/// queries and outputs; at least one).
pub fn attn_blas_block(h: usize, dh: usize, max_keys: usize) -> usize {
    (BLAS_BLOCK_BYTES / attn_blas_query_bytes(h, dh, max_keys)).max(1)
}

fn attn_blas_query_bytes(h: usize, dh: usize, max_keys: usize) -> usize {
    8 * (max_keys * dh + 2 * h * max_keys + 2 * h * dh) + 4
}

/// Device bytes the batched-DGEMM attention and indexer scoring keep beside the activations
/// for calls of at most `rows` queries of `h` heads of `dh` over at most `max_keys` keys, and
/// (CSA layers) `hi` indexer heads of `di` over `n_c` compressed rows: each block at most
/// [`BLAS_BLOCK_BYTES`], every allocation counted twice (scratch buffers are rounded up to a
/// power of two), and the indexer's f64 keys.
pub fn blas_scratch_bytes(
    rows: usize,
    (h, dh, max_keys): (usize, usize, usize),
    index: Option<(usize, usize, usize)>,
) -> usize {
    let attn = (rows * attn_blas_query_bytes(h, dh, max_keys)).min(BLAS_BLOCK_BYTES);
    let idx = index.map_or(0, |(hi, di, n_c)| {
        let s = (rows * hi * n_c * 8).min(BLAS_BLOCK_BYTES);
        let sub = (BLAS_BLOCK_BYTES / (hi * n_c * 8).max(1)).clamp(1, rows.max(1));
        s + sub * hi * di * 8 + n_c * di * 8
    });
    2 * (attn + idx)
}

/// Rows per scoring block for n_c compressed rows (at least one).
pub fn score_block_rows(n_c: usize) -> usize {
    (SCORE_BLOCK_BYTES / 4 / n_c.max(1)).max(1)
}

/// The indexer's score of compressed row j for query ti (j < n_c): Σ_h relu(f32(q_h·k_j)) · w_h,
/// summed over heads in order from +0 in f32. `q` [t, hi·di], `ki` [n_c, di], `w` [t, hi] (already
/// scaled) → [t, n_c].
pub fn indexer_scores(
    q: &[f32],
    ki: &[f32],
    w: &[f32],
    t: usize,
    hi: usize,
    di: usize,
    n_c: usize,
) -> Vec<f32> {
    let mut out = vec![0.0f32; t * n_c];
    out.par_chunks_mut(n_c.max(1))
        .enumerate()
        .for_each(|(ti, o)| {
            for (j, ov) in o.iter_mut().enumerate() {
                let kj = &ki[j * di..(j + 1) * di];
                *ov = (0..hi).fold(0.0f32, |acc, hh| {
                    let s = dot64(&q[(ti * hi + hh) * di..(ti * hi + hh + 1) * di], kj) as f32;
                    acc + s.max(0.0) * w[ti * hi + hh]
                });
            }
        });
    out
}

/// Shapes of the indexer's top-k: t queries of hi heads of width di against n_c compressed rows
/// (the layer's ratio sets each query's causal count), kk rows kept per query.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IndexerDims {
    pub t: usize,
    pub hi: usize,
    pub di: usize,
    /// Compressed rows (keys), counted from the prompt's start.
    pub n_c: usize,
    pub ratio: usize,
    pub kk: usize,
    /// Position of the first query in the prompt (0 unless the queries are a later token chunk).
    pub q0: usize,
}

impl IndexerDims {
    /// Compressed rows scored, summed over the call's queries (each its causal rows: the work of
    /// the scores is 2 · hi · di per row).
    pub fn scored(&self) -> u64 {
        (0..self.t).map(|i| self.causal(i) as u64).sum()
    }

    /// The compressed rows query `i` of this call (at position q0 + i) may see:
    /// min((q0 + i + 1) / ratio, n_c).
    #[inline]
    pub fn causal(&self, i: usize) -> usize {
        if self.ratio == 0 {
            return 0;
        }
        ((self.q0 + i + 1) / self.ratio).min(self.n_c)
    }
}

/// One query's selection from its scores over its m causal rows into `o` [kk]: all m rows when
/// m ≤ kk, else the kk first in top-k order (larger score first, exact ties toward the lower
/// row, NaN lowest: [`topk_order`]), as ascending row indices (f32), −1 after the last.
pub fn topk_rows(score: &[f32], m: usize, o: &mut [f32]) {
    let kk = o.len();
    o.iter_mut().for_each(|v| *v = -1.0);
    if m <= kk {
        (0..m).for_each(|s| o[s] = s as f32);
        return;
    }
    if kk == 0 {
        return;
    }
    let score = &score[..m];
    let mut order: Vec<usize> = (0..m).collect();
    // A total order, so the kk first are the same set as after a full sort.
    order.select_nth_unstable_by(kk - 1, |&a, &b| topk_order(score[a], a, score[b], b));
    let mut pick = order[..kk].to_vec();
    pick.sort_unstable();
    for (slot, p) in o.iter_mut().zip(pick) {
        *slot = p as f32;
    }
}

/// The indexer's selection [t, kk] (f32 row indices, ascending, −1 after the last) of the
/// queries q [t, hi·di] over the compressed keys ki [n_c, di] with the head weights w [t, hi]
/// (already scaled): each query keeps [`topk_rows`] of its [`indexer_scores`] over its causal
/// rows. The queries are scored `rows` at a time against the rows the block's last query may
/// see (no score beyond a causal count is needed; a block whose queries all keep every causal
/// row is not scored), so at most rows × n_c scores exist at once ([`score_block_rows`]).
pub fn indexer_topk(q: &[f32], ki: &[f32], w: &[f32], d: IndexerDims, rows: usize) -> Vec<f32> {
    let IndexerDims { t, hi, di, kk, .. } = d;
    let mut out = vec![-1.0f32; t * kk];
    if kk == 0 {
        return out;
    }
    let rows = rows.max(1);
    for (t0, t1) in chunks(t, rows) {
        let m_b = d.causal(t1 - 1);
        let scores = if m_b > kk {
            indexer_scores(
                &q[t0 * hi * di..t1 * hi * di],
                &ki[..m_b * di],
                &w[t0 * hi..t1 * hi],
                t1 - t0,
                hi,
                di,
                m_b,
            )
        } else {
            Vec::new()
        };
        out[t0 * kk..t1 * kk]
            .par_chunks_mut(kk)
            .enumerate()
            .for_each(|(i, o)| {
                let m = d.causal(t0 + i);
                let s = if m > kk { &scores[i * m_b..] } else { &[][..] };
                topk_rows(s, m, o);
            });
    }
    out
}

/// Indices of the `k` largest keys in top-k order (larger first, exact ties toward the lower
/// index, NaN as −inf), by repeated selection: the same rule as [`topk_order`], in a form a
/// device thread runs unchanged.
pub fn topk_select(keys: &[f32], k: usize, out: &mut [usize]) {
    let kv = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    // a comes before b
    let before = |a: usize, b: usize| {
        let (ka, kb) = (kv(keys[a]), kv(keys[b]));
        ka > kb || (ka == kb && a < b)
    };
    let mut prev: Option<usize> = None;
    for slot in out.iter_mut().take(k) {
        let mut best: Option<usize> = None;
        for i in 0..keys.len() {
            if prev.is_some_and(|p| !before(p, i)) {
                continue;
            }
            if best.is_none_or(|b| before(i, b)) {
                best = Some(i);
            }
        }
        let b = best.unwrap_or(0);
        *slot = b;
        prev = Some(b);
    }
}

/// Router scoring functions (config `scoring_func`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scoring {
    SqrtSoftplus = 0,
    Sigmoid = 1,
    Softmax = 2,
}

impl Scoring {
    pub fn parse(s: &str) -> Option<Scoring> {
        match s {
            "sqrtsoftplus" => Some(Scoring::SqrtSoftplus),
            "sigmoid" => Some(Scoring::Sigmoid),
            "softmax" => Some(Scoring::Softmax),
            _ => None,
        }
    }
}

/// A router's shape and weighting: `t` tokens, `e` experts, `k` chosen per token; the scoring
/// function, whether the k weights are normalised by their f32 sum, and the routed scaling
/// factor they are multiplied by.
#[derive(Clone, Copy, Debug)]
pub struct Routing {
    pub t: usize,
    pub e: usize,
    pub k: usize,
    pub f: Scoring,
    pub norm: bool,
    pub rs: f32,
}

/// Routing of the learned router (not hash layers): scores of `logits` [t, e], top-k of
/// score + bias, weights = the chosen scores, normalised by their f32 sum when `norm`, times `rs`.
/// Returns (weights [t, k], expert ids [t, k]).
pub fn route(logits: &[f32], bias: &[f32], r: Routing) -> (Vec<f32>, Vec<usize>) {
    let Routing {
        t,
        e,
        k,
        f,
        norm,
        rs,
    } = r;
    let scores = route_scores(logits, e, f);
    let mut idx = vec![0usize; t * k];
    let mut keys = vec![0.0f32; e];
    for ti in 0..t {
        let s = &scores[ti * e..(ti + 1) * e];
        keys.iter_mut()
            .zip(s.iter().zip(bias))
            .for_each(|(kk, (a, b))| *kk = a + b);
        topk_select(&keys, k, &mut idx[ti * k..(ti + 1) * k]);
    }
    let w = route_weights(&scores, &idx, t, e, k, norm, rs);
    (w, idx)
}

/// The router's scores of logits [t, e].
pub fn route_scores(logits: &[f32], e: usize, f: Scoring) -> Vec<f32> {
    let mut scores = logits.to_vec();
    match f {
        Scoring::SqrtSoftplus => scores.iter_mut().for_each(|v| *v = softplus(*v).sqrt()),
        Scoring::Sigmoid => scores.iter_mut().for_each(|v| *v = sigmoid(*v)),
        Scoring::Softmax => scores.chunks_mut(e.max(1)).for_each(softmax),
    }
    scores
}

/// A hash layer's routing weights: its table chose `idx` [t, k]; the gate's `logits` [t, e] score
/// only those choices where the scoring is elementwise (sigmoid, sqrt-softplus: the same values
/// as scoring every logit, 1/(e/k) of the work; a softmax scores whole rows).
pub fn hash_route_weights(logits: &[f32], idx: &[usize], r: Routing) -> Vec<f32> {
    let Routing {
        t,
        e,
        k,
        f,
        norm,
        rs,
    } = r;
    if f == Scoring::Softmax {
        return route_weights(&route_scores(logits, e, f), idx, t, e, k, norm, rs);
    }
    let chosen: Vec<f32> = (0..t * k).map(|i| logits[(i / k) * e + idx[i]]).collect();
    let own: Vec<usize> = (0..t * k).map(|i| i % k).collect();
    route_weights(&route_scores(&chosen, k, f), &own, t, k, k, norm, rs)
}

/// Routing weights from the chosen experts' scores.
pub fn route_weights(
    scores: &[f32],
    idx: &[usize],
    t: usize,
    e: usize,
    k: usize,
    norm: bool,
    rs: f32,
) -> Vec<f32> {
    let mut wts = vec![0.0f32; t * k];
    for ti in 0..t {
        let w = &mut wts[ti * k..(ti + 1) * k];
        for j in 0..k {
            w[j] = scores[ti * e + idx[ti * k + j]];
        }
        if norm {
            let s = sum_f32(w.iter().copied());
            w.iter_mut().for_each(|v| *v /= s);
        }
        w.iter_mut().for_each(|v| *v *= rs);
    }
    wts
}

/// Order for top-k: larger score first, exact ties toward the lower index, NaN treated as −inf
/// (never chosen over a number). A total order, so sorting cannot panic on odd data; −0 equals +0.
pub fn topk_order(sa: f32, a: usize, sb: f32, b: usize) -> std::cmp::Ordering {
    let k = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
    k(sb)
        .partial_cmp(&k(sa))
        .unwrap_or(std::cmp::Ordering::Equal)
        .then(a.cmp(&b))
}

#[cfg(test)]
mod work_tests {
    use super::*;

    #[test]
    fn hash_routing_scores_only_the_chosen_logits_with_the_same_bits() {
        let (t, e, k) = (37, 24, 5);
        let mut s = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let logits: Vec<f32> = (0..t * e)
            .map(|_| (next() % 20_000) as f32 / 1000.0 - 10.0)
            .collect();
        let idx: Vec<usize> = (0..t * k).map(|_| (next() % e as u64) as usize).collect();
        for f in [Scoring::SqrtSoftplus, Scoring::Sigmoid, Scoring::Softmax] {
            for (norm, rs) in [(true, 2.5f32), (false, 1.0)] {
                let whole = route_weights(&route_scores(&logits, e, f), &idx, t, e, k, norm, rs);
                let r = Routing {
                    t,
                    e,
                    k,
                    f,
                    norm,
                    rs,
                };
                let hashed = hash_route_weights(&logits, &idx, r);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&whole), bits(&hashed), "{f:?} norm {norm}");
            }
        }
    }

    #[test]
    fn keys_and_scored_rows_count_by_hand() {
        let d = AttnDims {
            t: 5,
            h: 1,
            dh: 8,
            n_c: 2,
            win: 3,
            scale: 1.0,
            q0: 0,
            kv0: 0,
        };
        // window min(p + 1, 3): 1 2 3 3 3
        assert_eq!(d.keys(0, None), 12);
        // + causal compressed rows min((p + 1) / 2, 2): 0 1 1 2 2
        assert_eq!(d.keys(2, None), 18);
        // + at most one selected: 0 1 1 1 1
        assert_eq!(d.keys(2, Some(1)), 16);
        let i = IndexerDims {
            t: 5,
            hi: 2,
            di: 4,
            n_c: 10,
            ratio: 4,
            kk: 3,
            q0: 3,
        };
        // positions 3..8: (p + 1) / 4 = 1 1 1 1 2
        assert_eq!(i.scored(), 6);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dgemm_attention_blocks_fit_their_bound() {
        // V4-Flash CSA at 4k: 64 heads of 512 over 128 window + 512 selected keys; per query
        // 8 · (640·512 + 2·64·640 + 2·64·512) + 4 bytes
        let per = 8 * (640 * 512 + 2 * 64 * 640 + 2 * 64 * 512) + 4;
        let b = attn_blas_block(64, 512, 640);
        assert!(
            b * per <= BLAS_BLOCK_BYTES && (b + 1) * per > BLAS_BLOCK_BYTES,
            "{b}"
        );
        assert_eq!(attn_blas_block(64, 512, 1 << 30), 1);
        // small calls count what they hold, twice (power-of-two scratch): 10 queries of 4 heads
        // of 8 over 20 keys, 2 indexer heads of 4 over 5 rows
        let attn = 10 * (8 * (20 * 8 + 2 * 4 * 20 + 2 * 4 * 8) + 4);
        assert_eq!(blas_scratch_bytes(10, (4, 8, 20), None), 2 * attn);
        let idx = 10 * 2 * 5 * 8 + 10 * 2 * 4 * 8 + 5 * 4 * 8;
        assert_eq!(
            blas_scratch_bytes(10, (4, 8, 20), Some((2, 4, 5))),
            2 * (attn + idx)
        );
        // long prompts: each block at its bound
        let big = blas_scratch_bytes(16384, (64, 512, 640), Some((64, 128, 32768)));
        assert!(
            (4 * BLAS_BLOCK_BYTES..=6 * BLAS_BLOCK_BYTES).contains(&big),
            "{big}"
        );
    }

    /// Uniform values in [−1, 1) from a fixed LCG (never exactly zero is not needed here).
    fn lcg(seed: u64, n: usize) -> Vec<f32> {
        let mut s = seed;
        (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// The selection of one query by an independent full sort of its causal scores.
    fn by_full_sort(s: &[f32], m: usize, kk: usize) -> Vec<f32> {
        let mut order: Vec<usize> = (0..m).collect();
        order.sort_by(|&x, &y| topk_order(s[x], x, s[y], y));
        let mut pick = order[..m.min(kk)].to_vec();
        pick.sort_unstable();
        let mut o = vec![-1.0f32; kk];
        for (j, p) in pick.into_iter().enumerate() {
            o[j] = p as f32;
        }
        o
    }

    /// Ties (exact, ±0), NaN and ±inf scores select what a full sort in top-k order selects.
    #[test]
    fn topk_rows_follows_the_full_sort_on_ties_nan_and_signed_zeros() {
        let s = [
            0.5f32,
            -0.0,
            f32::NAN,
            0.5,
            0.0,
            f32::NEG_INFINITY,
            f32::INFINITY,
            0.5,
            -1.0,
            f32::NAN,
            0.0,
        ];
        for m in [0usize, 3, s.len()] {
            for kk in [0usize, 1, 2, 4, 5, 7, 9, 10, 11, 12] {
                let mut o = vec![7.0f32; kk];
                topk_rows(&s, m, &mut o);
                assert_eq!(o, by_full_sort(&s, m, kk), "m {m} kk {kk}");
            }
        }
        // −0 and +0 tie: the lower row wins whichever sign it has
        let mut o = vec![0.0f32; 1];
        topk_rows(&[-1.0, -0.0, 0.0], 3, &mut o);
        assert_eq!(o, vec![1.0]);
    }

    /// Scoring and selecting in query blocks of any size picks, for every query, the top kk of
    /// its causal rows by an independent full sort of the whole [t, n_c] scores.
    #[test]
    fn blocks_of_any_size_select_what_a_full_sort_selects() {
        let (t, hi, di, n_c, ratio, kk) = (57usize, 3usize, 8usize, 14usize, 4usize, 3usize);
        let q = lcg(9, t * hi * di);
        let mut ki = lcg(10, n_c * di);
        // two equal rows: exact ties go to the lower index
        let (a, b) = (ki[2 * di..3 * di].to_vec(), 5 * di);
        ki[b..b + di].copy_from_slice(&a);
        let w: Vec<f32> = lcg(11, t * hi).iter().map(|v| v * 0.3).collect();
        let scores = indexer_scores(&q, &ki, &w, t, hi, di, n_c);
        let d = IndexerDims {
            q0: 0,
            t,
            hi,
            di,
            n_c,
            ratio,
            kk,
        };
        let mut want = Vec::new();
        for ti in 0..t {
            want.extend(by_full_sort(&scores[ti * n_c..], d.causal(ti), kk));
        }
        for rows in [1usize, 5, 16, t, 10 * t] {
            assert_eq!(
                indexer_topk(&q, &ki, &w, d, rows),
                want,
                "blocks of {rows} rows"
            );
        }
        assert_eq!(
            indexer_topk(&q, &ki, &w, IndexerDims { kk: 0, ..d }, 4),
            Vec::<f32>::new()
        );
    }

    #[test]
    fn chunks_cover_the_prompt_once_and_a_bad_selection_is_named() {
        let c: Vec<_> = chunks(10, 4).collect();
        assert_eq!(c, vec![(0, 4), (4, 8), (8, 10)]);
        assert_eq!(chunks(3, 0).count(), 3);
        assert_eq!(chunks(0, 5).count(), 0);
        assert_eq!(chunks(5, 9).collect::<Vec<_>>(), vec![(0, 5)]);
        assert_eq!(selection_error(&[-1.0, 0.0, 4.0], 5), None);
        for bad in [5.0f32, 2.5, -2.0, f32::NAN, f32::INFINITY, -0.5] {
            let got = selection_error(&[-1.0, 1.0, bad, 7.5], 5);
            assert_eq!(got.map(f32::to_bits), Some(bad.to_bits()), "{bad}");
        }
        assert!(selection_error_msg(2.5, 5).contains("2.5"));
        let a = AttnDims {
            t: 20,
            h: 1,
            dh: 1,
            n_c: 0,
            win: 4,
            scale: 1.0,
            q0: 0,
            kv0: 0,
        };
        let b = a.sub(10, 15);
        assert_eq!((b.t, b.q0, b.kv0), (5, 10, 7));
        assert_eq!(a.sub(2, 9).kv0, 0);
        assert_eq!(AttnDims { win: 0, ..a }.sub(6, 8).kv0, 6);
    }

    #[test]
    fn topk_select_matches_the_sort_order() {
        let s = [0.5f32, 2.0, f32::NAN, 2.0, -0.0, 0.0, f32::NEG_INFINITY];
        let mut idx: Vec<usize> = (0..s.len()).collect();
        idx.sort_by(|&a, &b| topk_order(s[a], a, s[b], b));
        for k in 0..=s.len() {
            let mut out = vec![0usize; k];
            topk_select(&s, k, &mut out);
            assert_eq!(out, idx[..k].to_vec(), "k = {k}");
        }
    }

    #[test]
    fn softmax_and_sigmoid_in_f64() {
        let mut r = vec![0.0, f32::NEG_INFINITY, (2.0f32).ln()];
        softmax(&mut r);
        assert!((r[0] - 1.0 / 3.0).abs() < 1e-7 && r[1] == 0.0 && (r[2] - 2.0 / 3.0).abs() < 1e-7);
        let mut z = vec![f32::NEG_INFINITY; 3];
        softmax(&mut z);
        assert_eq!(z, vec![0.0; 3]);
        assert_eq!(sigmoid(0.0), 0.5);
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert!((softplus(100.0) - 100.0).abs() < 1e-5);
    }

    #[test]
    fn attention_with_only_the_sink_visible_is_zero_and_one_key_is_that_key() {
        // t = 1, window 1: the only key is the query's own row; p = e^s / (e^s + e^sink)
        let q = vec![1.0f32, 0.0];
        let kv = vec![2.0f32, 3.0];
        let a = AttnDims {
            t: 1,
            h: 1,
            dh: 2,
            n_c: 0,
            win: 1,
            scale: 1.0,
            q0: 0,
            kv0: 0,
        };
        let o = attention_core(&q, &kv, &[], CmpKeys::NONE, &[0.0], a);
        let p = (2f64.exp() / (2f64.exp() + 1.0)) as f32 as f64;
        assert_eq!(o, vec![(p * 2.0) as f32, (p * 3.0) as f32]);
        let o0 = attention_core(
            &q,
            &kv,
            &[],
            CmpKeys::NONE,
            &[0.0],
            AttnDims { win: 0, ..a },
        );
        assert_eq!(o0, vec![0.0, 0.0]);
    }

    #[test]
    fn compressed_rows_are_causal_and_follow_the_selection() {
        let all = CmpKeys {
            ratio: 4,
            sel: None,
        };
        let rows = |k: &CmpKeys, i: usize, p: usize| k.rows(i, p, 2).collect::<Vec<_>>();
        assert_eq!(rows(&all, 0, 0), Vec::<usize>::new()); // (0+1)/4 = 0 rows
        assert_eq!(rows(&all, 3, 3), vec![0]);
        assert_eq!(rows(&all, 7, 7), vec![0, 1]);
        // a repeated, unsorted, out-of-range selection becomes one ascending list per query
        let sel: Vec<f32> = (0..8).flat_map(|_| [1.0f32, -1.0, 0.0, 1.0, 5.0]).collect();
        let lists = selection_lists(&sel, 5, 2);
        assert_eq!(&lists[..5], &[0, 1, -1, -1, -1]);
        let picked = CmpKeys {
            ratio: 4,
            sel: Some((&lists, 5)),
        };
        assert_eq!(rows(&picked, 3, 3), vec![0]); // row 1 not causal yet
        assert_eq!(rows(&picked, 7, 7), vec![0, 1]);
        // a later chunk: query 0 of the block sits at position 7
        assert_eq!(rows(&picked, 0, 7), vec![0, 1]);
        assert_eq!(picked.max_rows(2), 2);
        assert_eq!(CmpKeys::NONE.max_rows(9), 0);
    }

    /// A block of queries with its window's earlier rows (q0, kv0) computes the same bits as
    /// the whole prompt's rows: chunked execution of the core is exact.
    #[test]
    fn a_query_block_equals_the_same_rows_of_the_whole_prompt() {
        let (t, h, dh, win, ratio) = (23usize, 2usize, 4usize, 5usize, 4usize);
        let n_c = t / ratio;
        let r = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
        let q: Vec<f32> = (0..t * h * dh).map(r).collect();
        let kv: Vec<f32> = (0..t * dh).map(|i| r(i + 7)).collect();
        let cmp: Vec<f32> = (0..n_c * dh).map(|i| r(i + 11)).collect();
        let keys = CmpKeys { ratio, sel: None };
        let a = AttnDims {
            t,
            h,
            dh,
            n_c,
            win,
            scale: 0.5,
            q0: 0,
            kv0: 0,
        };
        let whole = attention_core(&q, &kv, &cmp, keys, &[0.1, -0.2], a);
        for (q0, q1) in [(0usize, 6usize), (6, 13), (13, 23)] {
            let kv0 = (q0 + 1).saturating_sub(win);
            let b = AttnDims {
                t: q1 - q0,
                q0,
                kv0,
                ..a
            };
            let part = attention_core(
                &q[q0 * h * dh..q1 * h * dh],
                &kv[kv0 * dh..q1 * dh],
                &cmp,
                keys,
                &[0.1, -0.2],
                b,
            );
            assert_eq!(
                part,
                whole[q0 * h * dh..q1 * h * dh].to_vec(),
                "block {q0}..{q1}"
            );
        }
    }
    #[test]
    fn topk_order_prefers_larger_then_lower_index() {
        let s = [0.5f32, 2.0, f32::NAN, 2.0, -0.0, 0.0];
        let mut idx: Vec<usize> = (0..6).collect();
        idx.sort_by(|&a, &b| topk_order(s[a], a, s[b], b));
        assert_eq!(idx, vec![1, 3, 0, 4, 5, 2]);
    }
}
