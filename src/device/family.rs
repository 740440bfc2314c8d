//! The host references of the ops the model families add (`model::family`): the causal
//! grouped-query attention with optional sinks and a sliding window (Qwen3-MoE, gpt-oss, and
//! DeepSeek-V3's MLA once its keys are gathered), MLA's key/value gather, RoPE with
//! transformers' half-split pairing, a column slice, and gpt-oss's clamped GLU.
//!
//! The same rules as `kern`'s make the CUDA kernels (`kernels/layer.cu`) agree bit for bit:
//! every dot product, softmax denominator and weighted sum is exact f32 products summed in f64
//! and rounded once; exponentials in f64; the attention's weighted sum over keys runs in key
//! order on both (one thread per output channel on the device).

use rayon::prelude::*;

use super::kern::{dot64, exp64, sum64};

/// Shapes and constants of the grouped-query attention: q [t, h·dq], k [q0 + t, kvh·dq],
/// v [q0 + t, kvh·dv] → [t, h·dv]; query head i reads key/value head i / (h / kvh). Query row r
/// is key row q0 + r: a later token chunk's queries over the keys kept from earlier chunks
/// (`q0` of them) and its own.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GqaDims {
    pub t: usize,
    /// Key rows before the first query's own (0 when q and k cover the same tokens).
    pub q0: usize,
    pub h: usize,
    pub kvh: usize,
    pub dq: usize,
    pub dv: usize,
    pub scale: f32,
    /// Keys per query including itself (sliding layers); `None`: every earlier key.
    pub window: Option<usize>,
}

impl GqaDims {
    /// Query heads per key/value head (at least 1).
    pub fn group(&self) -> usize {
        (self.h / self.kvh.max(1)).max(1)
    }

    /// The keys of the query at position p: [lo, p] (empty for a window of 0).
    pub fn keys(&self, p: usize) -> std::ops::Range<usize> {
        let lo = self.window.map_or(0, |w| (p + 1).saturating_sub(w));
        lo..p + 1
    }

    /// Whether q, k, v and the sinks have the sizes these dims ask for (the devices' shared
    /// check; the model's op checks the shapes first and names them).
    pub fn fits(&self, q: usize, k: usize, v: usize, sinks: Option<usize>) -> bool {
        let tk = self.q0 + self.t;
        q == self.t * self.h * self.dq
            && k == tk * self.kvh * self.dq
            && v == tk * self.kvh * self.dv
            && self.kvh > 0
            && self.h.is_multiple_of(self.kvh)
            && sinks.is_none_or(|n| n == self.h)
    }
}

/// Causal grouped-query attention (before the path's storage rounding). Per query and head:
/// scores f32(q·k in f64) · scale over the query's keys ([`GqaDims::keys`]); softmax with the
/// max over the scores (and the head's sink logit, if any), f64 exponentials and denominator
/// (the sink's exponential included), probabilities rounded to f32; output Σ p·v in f64 in key
/// order, rounded once. Memory: one query's scores at a time per task, never [t, t].
pub fn gqa_core(q: &[f32], k: &[f32], v: &[f32], sinks: Option<&[f32]>, a: GqaDims) -> Vec<f32> {
    let GqaDims {
        t,
        h,
        kvh,
        dq,
        dv,
        scale,
        ..
    } = a;
    let group = a.group();
    let mut out = vec![0.0f32; t * h * dv];
    out.par_chunks_mut(dv.max(1))
        .enumerate()
        .for_each(|(task, o)| {
            let (ti, head) = (task / h, task % h);
            let g = head / group;
            let qv = &q[(ti * h + head) * dq..(ti * h + head + 1) * dq];
            let keys = a.keys(a.q0 + ti);
            let s: Vec<f32> = keys
                .clone()
                .map(|j| {
                    let kj = &k[(j * kvh + g) * dq..(j * kvh + g + 1) * dq];
                    (dot64(qv, kj) as f32) * scale
                })
                .collect();
            let sink = sinks.map(|s| s[head]);
            let mx = s
                .iter()
                .cloned()
                .fold(sink.unwrap_or(f32::NEG_INFINITY), f32::max);
            let den =
                sink.map_or(0.0, |sk| exp64(sk - mx)) + sum64(s.iter().map(|&x| exp64(x - mx)));
            let mut acc = vec![0.0f64; dv];
            for (j, &sj) in keys.zip(&s) {
                let p = (exp64(sj - mx) / den) as f32 as f64;
                let vj = &v[(j * kvh + g) * dv..(j * kvh + g + 1) * dv];
                acc.iter_mut()
                    .zip(vj)
                    .for_each(|(a, &x)| *a += p * x as f64);
            }
            o.iter_mut().zip(&acc).for_each(|(o, a)| *o = *a as f32);
        });
    out
}

/// Shapes of MLA's key/value gather (DeepSeek-V3): `kv_b` rows [t, h·(nope + dv)] (head i's
/// k_nope then its v), `kv_a` rows [t, lora + rope] (the latent, then the rope key every head
/// shares).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaDims {
    pub t: usize,
    pub h: usize,
    pub nope: usize,
    pub rope: usize,
    pub dv: usize,
    pub lora: usize,
}

/// MLA's keys k [t, h·(nope + rope)] (head i: [k_nope_i, k_rope]) and values v [t, h·dv] from
/// `kv_b` and the rope-applied `kv_a` ([`MlaDims`]): a copy, nothing rounded.
pub fn mla_keys(kvb: &[f32], kva: &[f32], d: MlaDims) -> (Vec<f32>, Vec<f32>) {
    let MlaDims {
        t,
        h,
        nope,
        rope,
        dv,
        lora,
    } = d;
    let mut k = Vec::with_capacity(t * h * (nope + rope));
    let mut v = Vec::with_capacity(t * h * dv);
    for ti in 0..t {
        let row = &kvb[ti * h * (nope + dv)..(ti + 1) * h * (nope + dv)];
        let kr = &kva[ti * (lora + rope) + lora..(ti + 1) * (lora + rope)];
        for head in row.chunks(nope + dv) {
            k.extend_from_slice(&head[..nope]);
            k.extend_from_slice(kr);
            v.extend_from_slice(&head[nope..]);
        }
    }
    (k, v)
}

/// Columns [c0, c0 + w) of each row of x [.., cols]: a copy.
pub fn slice_cols(x: &[f32], cols: usize, c0: usize, w: usize) -> Vec<f32> {
    if cols == 0 {
        return Vec::new();
    }
    x.chunks(cols)
        .flat_map(|row| row[c0..c0 + w].iter().copied())
        .collect()
}

/// gpt-oss's GLU α (transformers' `GptOssExperts.alpha`; not a config field).
pub const GLU_ALPHA: f64 = 1.702;

/// gpt-oss's clamped GLU of one unit: g = min(gate, L), u = clamp(up, ±L) (a NaN up stays NaN,
/// as Rust's `clamp`), then (u + 1) · g · σ(α·g) evaluated in f64 and rounded once.
pub fn glu_unit(gate: f32, up: f32, limit: f32) -> f32 {
    let g = gate.min(limit) as f64;
    let u = up.clamp(-limit, limit) as f64;
    let glu = g / (1.0 + (-GLU_ALPHA * g).exp());
    ((u + 1.0) * glu) as f32
}

/// [`glu_unit`] of `n` units: unit j's gate at `g[stride · j]`, its up at `u[stride · j]` (the
/// fused projection [n, 2I] interleaved: `g` = gu, `u` = gu[1..], stride 2; separate gate and up
/// projections: stride 1).
pub fn glu_pairs(g: &[f32], u: &[f32], stride: usize, n: usize, limit: f32) -> Vec<f32> {
    (0..n)
        .into_par_iter()
        .with_min_len(4096)
        .map(|j| glu_unit(g[stride * j], u[stride * j], limit))
        .collect()
}

/// [`glu_pairs`] of the fused projection's rows gu [n, 2I] (gate i at 2i, up i at 2i + 1) →
/// [n, I].
pub fn glu_rows(gu: &[f32], limit: f32) -> Vec<f32> {
    let n = gu.len() / 2;
    glu_pairs(gu, &gu[1.min(gu.len())..], 2, n, limit)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gqa_of_one_key_is_its_value_and_heads_share_their_group() {
        // t = 2, h = 2, kv = 1: both heads read the same key/value head
        let q = vec![1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0];
        let k = vec![1.0, 0.0, 0.0, 2.0];
        let v = vec![3.0, 4.0, 5.0, 6.0];
        let a = GqaDims {
            t: 2,
            q0: 0,
            h: 2,
            kvh: 1,
            dq: 2,
            dv: 2,
            scale: 1.0,
            window: None,
        };
        assert!(a.fits(q.len(), k.len(), v.len(), None));
        assert!(!a.fits(q.len(), k.len(), v.len(), Some(3)));
        let o = gqa_core(&q, &k, &v, None, a);
        // row 0: only key 0
        assert_eq!(&o[..4], &[3.0, 4.0, 3.0, 4.0]);
        // row 1, head 0: scores 1 and 0; head 1: scores 0 and 2
        let p = |a: f64, b: f64| (a.exp() / (a.exp() + b.exp())) as f32 as f64;
        let (p0, p1) = (p(1.0, 0.0), p(2.0, 0.0));
        let want = [
            (p0 * 3.0 + (1.0 - p0) * 5.0) as f32,
            (p0 * 4.0 + (1.0 - p0) * 6.0) as f32,
        ];
        assert!((o[4] - want[0]).abs() < 1e-6 && (o[5] - want[1]).abs() < 1e-6);
        assert!((o[6] as f64 - ((1.0 - p1) * 3.0 + p1 * 5.0)).abs() < 1e-6);
        // a window of one key: each query sees itself only
        let w1 = GqaDims {
            window: Some(1),
            ..a
        };
        assert_eq!(&gqa_core(&q, &k, &v, None, w1)[4..], &[5.0, 6.0, 5.0, 6.0]);
        // a sink takes its share of the denominator: row 0 sees one key of score 1 (head 0)
        let o = gqa_core(&q, &k, &v, Some(&[0.0, 0.0]), a);
        let ps = (1f64.exp() / (1f64.exp() + 1.0)) as f32 as f64;
        assert!((o[0] as f64 - ps * 3.0).abs() < 1e-6, "{}", o[0]);
    }

    /// A later token chunk's queries over the keys kept before it (`q0` of them: every earlier
    /// one, or a window's last w − 1) give the whole prompt's rows bit for bit, with sinks.
    #[test]
    fn a_later_chunk_over_its_kept_keys_gives_the_whole_prompt_s_rows() {
        let (t, h, kvh, dq, dv) = (23, 4, 2, 8, 6);
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut r = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    ((x >> 11) as f64 / (1u64 << 53) as f64 * 4.0 - 2.0) as f32
                })
                .collect()
        };
        let (q, k, v, s) = (r(t * h * dq), r(t * kvh * dq), r(t * kvh * dv), r(h));
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        for window in [None, Some(5)] {
            let whole = GqaDims {
                t,
                q0: 0,
                h,
                kvh,
                dq,
                dv,
                scale: 0.3,
                window,
            };
            let all = gqa_core(&q, &k, &v, Some(&s), whole);
            for start in [1usize, 3, 7, 16] {
                let kept = window.map_or(start, |w| (w - 1).min(start));
                let k0 = start - kept;
                let part = GqaDims {
                    t: t - start,
                    q0: kept,
                    ..whole
                };
                let (kc, vc) = (&k[k0 * kvh * dq..], &v[k0 * kvh * dv..]);
                assert!(part.fits(q.len() - start * h * dq, kc.len(), vc.len(), Some(h)));
                let got = gqa_core(&q[start * h * dq..], kc, vc, Some(&s), part);
                assert_eq!(
                    bits(&got),
                    bits(&all[start * h * dv..]),
                    "window {window:?}, chunk from {start}"
                );
            }
        }
    }

    #[test]
    fn mla_keys_put_the_shared_rope_key_after_each_head_s_nope_part() {
        // t = 1, h = 2, nope 2, dv 1, lora 1, rope 2
        let d = MlaDims {
            t: 1,
            h: 2,
            nope: 2,
            rope: 2,
            dv: 1,
            lora: 1,
        };
        let kvb = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let kva = [9.0, 7.0, 8.0];
        let (k, v) = mla_keys(&kvb, &kva, d);
        assert_eq!(k, [1.0, 2.0, 7.0, 8.0, 4.0, 5.0, 7.0, 8.0]);
        assert_eq!(v, [3.0, 6.0]);
        assert_eq!(
            slice_cols(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], 3, 1, 2),
            [2.0, 3.0, 5.0, 6.0]
        );
    }

    /// The GLU against its definition, the clamps included: a gate above the limit is cut to it,
    /// an up beyond ±limit too, and the pairs are read interleaved.
    #[test]
    fn glu_clamps_and_reads_interleaved_pairs() {
        let sig = |z: f64| 1.0 / (1.0 + (-z).exp());
        let want = |g: f64, u: f64| ((u + 1.0) * g * sig(GLU_ALPHA * g)) as f32;
        // (gate, up) pairs: plain, gate over the limit, up under −limit, negative gate
        let gu = [0.5f32, -0.25, 9.0, 1.0, 1.0, -8.0, -3.0, 2.0];
        let h = glu_rows(&gu, 7.0);
        assert_eq!(h[0], want(0.5, -0.25));
        assert_eq!(h[1], want(7.0, 1.0));
        assert_eq!(h[2], want(1.0, -7.0));
        assert_eq!(h[3], want(-3.0, 2.0));
        // up = −1 zeroes the unit whatever the gate
        assert_eq!(glu_unit(4.0, -1.0, 7.0), 0.0);
        // separate gate and up projections pair the same units
        let (g, u): (Vec<f32>, Vec<f32>) = gu.chunks(2).map(|p| (p[0], p[1])).unzip();
        assert_eq!(glu_pairs(&g, &u, 1, 4, 7.0), h);
        // a NaN up stays NaN; a NaN gate becomes the limit (Rust's min)
        let n = glu_rows(&[1.0, f32::NAN, f32::NAN, 0.0], 7.0);
        assert!(n[0].is_nan());
        assert_eq!(n[1], want(7.0, 0.0));
    }
}
