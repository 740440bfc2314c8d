//! Per-tensor statistics and tensor-vs-reference comparisons. Metrics only read tensors.
//!
//! Everything is accumulated in f64 in one pass, so the numbers do not depend on the order the
//! backend produced the values in (within f64 rounding).

pub mod head;

use serde::{Deserialize, Serialize};

/// Statistics of one tensor.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    pub numel: usize,
    /// max |x| over finite elements (0 when none is finite).
    pub amax: f64,
    /// mean |x| over finite elements.
    pub mean_abs: f64,
    pub nan: usize,
    pub inf: usize,
    pub zeros: usize,
}

impl Stats {
    pub fn of(x: &[f32]) -> Stats {
        let mut acc = StatAcc::default();
        for &v in x {
            acc.add(v);
        }
        acc.finish(x.len())
    }
    /// True when any element is NaN or ±inf.
    pub fn non_finite(&self) -> bool {
        self.nan + self.inf > 0
    }
}

/// A tensor compared against a reference of the same shape.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Compare {
    /// Cosine similarity (None when a side has NaN/Inf or both are all-zero in a way that makes it undefined).
    pub cos: Option<f64>,
    /// ‖x − ref‖ / ‖ref‖ (None when undefined).
    pub rel_l2: Option<f64>,
    /// 10·log10(‖ref‖² / ‖x − ref‖²) in dB (None when undefined; capped at 300 for exact equality).
    pub sqnr_db: Option<f64>,
    /// max |x − ref| and the flat index where it occurs.
    pub max_abs_err: Option<f64>,
    pub max_abs_idx: Option<usize>,
    /// amax(x) / amax(ref) (None when the reference amax is 0).
    pub amax_ratio: Option<f64>,
    /// Elements that are NaN/Inf in x but finite in the reference.
    pub new_non_finite: usize,
    /// Elements equal to the reference's (`==`: NaN never): an index selection's agreement.
    /// Not in reports.
    #[serde(skip)]
    pub equal: usize,
}

/// One pass's sums over a tensor and its reference: inner products over the pairs where both are
/// finite, plus what makes the metrics undefined.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PairSums {
    pub dot: f64,
    pub nx: f64,
    pub nr: f64,
    pub ne: f64,
    /// amax of x and of the reference over the finite pairs.
    pub ax: f64,
    pub ar: f64,
    /// Largest |x − ref| and its first index.
    pub max_err: Option<(f64, usize)>,
    pub any_non_finite: bool,
    pub new_non_finite: usize,
    /// Pairs with x == ref (NaN never), finite or not.
    pub equal: usize,
}

/// Running statistics of one tensor (mergeable across chunks).
#[derive(Clone, Copy, Debug, Default)]
struct StatAcc {
    nan: usize,
    inf: usize,
    zeros: usize,
    finite: usize,
    amax: f64,
    sum: f64,
}

impl StatAcc {
    #[inline]
    fn add(&mut self, v: f32) {
        if v.is_nan() {
            self.nan += 1;
        } else if v.is_infinite() {
            self.inf += 1;
        } else {
            let a = v.abs() as f64;
            if a > self.amax {
                self.amax = a;
            }
            self.zeros += (v == 0.0) as usize;
            self.sum += a;
            self.finite += 1;
        }
    }
    fn merge(&mut self, o: &StatAcc) {
        self.nan += o.nan;
        self.inf += o.inf;
        self.zeros += o.zeros;
        self.finite += o.finite;
        self.amax = self.amax.max(o.amax);
        self.sum += o.sum;
    }
    fn finish(&self, numel: usize) -> Stats {
        Stats {
            numel,
            amax: self.amax,
            mean_abs: if self.finite > 0 {
                self.sum / self.finite as f64
            } else {
                0.0
            },
            nan: self.nan,
            inf: self.inf,
            zeros: self.zeros,
        }
    }
}

/// Running sums of a comparison (mergeable across chunks in index order).
#[derive(Clone, Copy, Debug, Default)]
struct PairAcc(PairSums);

impl PairAcc {
    #[inline]
    fn add(&mut self, i: usize, a: f32, b: f32) {
        let p = &mut self.0;
        p.equal += (a == b) as usize;
        if !a.is_finite() || !b.is_finite() {
            p.any_non_finite = true;
            p.new_non_finite += (!a.is_finite() && b.is_finite()) as usize;
            return;
        }
        let (a, b) = (a as f64, b as f64);
        p.dot += a * b;
        p.nx += a * a;
        p.nr += b * b;
        let e = a - b;
        p.ne += e * e;
        if p.max_err.is_none_or(|(m, _)| e.abs() > m) {
            p.max_err = Some((e.abs(), i));
        }
        p.ax = p.ax.max(a.abs());
        p.ar = p.ar.max(b.abs());
    }
    /// `o` covers later indices than `self`: on equal errors the earlier index stays.
    fn merge(&mut self, o: &PairAcc) {
        let (p, q) = (&mut self.0, &o.0);
        p.dot += q.dot;
        p.nx += q.nx;
        p.nr += q.nr;
        p.ne += q.ne;
        p.ax = p.ax.max(q.ax);
        p.ar = p.ar.max(q.ar);
        if let Some((e, i)) = q.max_err {
            if p.max_err.is_none_or(|(m, _)| e > m) {
                p.max_err = Some((e, i));
            }
        }
        p.any_non_finite |= q.any_non_finite;
        p.new_non_finite += q.new_non_finite;
        p.equal += q.equal;
    }
}

/// One metric item's sums and counts before they become [`Stats`] and a [`Compare`]: what a
/// pass over part of a tensor leaves, mergeable with the pass over the part after it
/// ([`Partial::merge_later`]), so a tensor measured in pieces (a prompt run in token chunks, a
/// device's per-chunk passes) gives the metrics of one pass.
#[derive(Clone, Copy, Debug, Default)]
pub struct Partial {
    /// Elements covered.
    pub numel: usize,
    stat: StatAcc,
    /// The comparison's sums, for an item with a reference.
    pair: Option<PairAcc>,
}

impl Partial {
    /// A device pass's counts and sums over `numel` elements (x's statistics; with a reference,
    /// the pair's sums, their largest error at an index counted from this pass's first element).
    #[allow(clippy::too_many_arguments)]
    pub fn from_counts(
        numel: usize,
        nan: usize,
        inf: usize,
        zeros: usize,
        finite: usize,
        amax: f64,
        sum_abs: f64,
        pair: Option<PairSums>,
    ) -> Partial {
        Partial {
            numel,
            stat: StatAcc {
                nan,
                inf,
                zeros,
                finite,
                amax,
                sum: sum_abs,
            },
            pair: pair.map(PairAcc),
        }
    }

    /// Add `later`, the pass over the `later.numel` elements right after this one's (its
    /// largest-error index is moved past this one's elements; on equal errors the earlier
    /// index stays).
    pub fn merge_later(&mut self, later: &Partial) {
        let mut o = *later;
        if let Some(p) = o.pair.as_mut() {
            if let Some((e, i)) = p.0.max_err {
                p.0.max_err = Some((e, i + self.numel));
            }
        }
        self.stat.merge(&o.stat);
        match (self.pair.as_mut(), o.pair) {
            (Some(a), Some(b)) => a.merge(&b),
            (None, Some(b)) if self.numel == 0 => self.pair = Some(b),
            _ => {}
        }
        self.numel += o.numel;
    }

    /// The statistics and, with a reference, the comparison.
    pub fn finish(&self) -> (Stats, Option<Compare>) {
        (
            self.stat.finish(self.numel),
            self.pair.map(|p| Compare::from_sums(&p.0)),
        )
    }
}

/// Elements per block of a metrics pass: sums accumulate sequentially inside a block and are
/// merged block by block in order, wherever the pass was cut.
const BLOCK: usize = 1 << 16;

/// The sums of `pairs` over `t[..][c0..c1]` (a block or part of one), continuing `acc`
/// (indices counted from `base`).
fn block_pass(
    t: &[&[f32]],
    pairs: &[(usize, Option<usize>)],
    c0: usize,
    c1: usize,
    base: usize,
    st: &mut [StatAcc],
    pa: &mut [PairAcc],
) {
    for (k, x) in t.iter().enumerate() {
        for &v in &x[c0..c1] {
            st[k].add(v);
        }
    }
    for (acc, &(i, j)) in pa.iter_mut().zip(pairs) {
        if let Some(j) = j {
            for (idx, (&a, &b)) in t[i][c0..c1].iter().zip(&t[j][c0..c1]).enumerate() {
                acc.add(base + c0 + idx, a, b);
            }
        }
    }
}

/// Statistics and comparisons of tensors that arrive a piece at a time (the token chunks of an
/// op), with the very sums of one pass over the whole: blocks of [`BLOCK`] elements counted from
/// the whole tensor's start accumulate in order whatever the pieces' sizes, complete blocks in
/// parallel.
pub struct Stream {
    pairs: Vec<(usize, Option<usize>)>,
    /// Elements fed so far.
    pos: usize,
    /// The block in progress.
    cur: (Vec<StatAcc>, Vec<PairAcc>),
    /// Every complete block, merged in order.
    total: (Vec<StatAcc>, Vec<PairAcc>),
}

impl Stream {
    /// A stream over `tensors` same-length tensors measured as `pairs`.
    pub fn new(tensors: usize, pairs: &[(usize, Option<usize>)]) -> Stream {
        let z = || {
            (
                vec![StatAcc::default(); tensors],
                vec![PairAcc::default(); pairs.len()],
            )
        };
        Stream {
            pairs: pairs.to_vec(),
            pos: 0,
            cur: z(),
            total: z(),
        }
    }

    fn close_block(&mut self) {
        let (s, p) = std::mem::replace(
            &mut self.cur,
            (
                vec![StatAcc::default(); self.total.0.len()],
                vec![PairAcc::default(); self.pairs.len()],
            ),
        );
        merge_into(&mut self.total, &s, &p);
    }

    /// The next piece of every tensor (same lengths).
    pub fn feed(&mut self, t: &[&[f32]]) {
        use rayon::prelude::*;
        let n = t.first().map_or(0, |x| x.len());
        assert!(
            t.len() == self.total.0.len() && t.iter().all(|x| x.len() == n),
            "metrics stream: tensors of other lengths"
        );
        let base = self.pos;
        let mut c = 0;
        // the rest of the block in progress
        let fill = (BLOCK - self.pos % BLOCK).min(n);
        if !self.pos.is_multiple_of(BLOCK) || fill < BLOCK {
            let (st, pa) = &mut self.cur;
            block_pass(t, &self.pairs, 0, fill, base, st, pa);
            c = fill;
            self.pos += fill;
            if self.pos.is_multiple_of(BLOCK) {
                self.close_block();
            }
        }
        // whole blocks, in parallel, merged in order
        let whole = (n - c) / BLOCK;
        if whole > 0 {
            let pairs = &self.pairs;
            let k = t.len();
            let parts: Vec<(Vec<StatAcc>, Vec<PairAcc>)> = (0..whole)
                .into_par_iter()
                .map(|b| {
                    let mut st = vec![StatAcc::default(); k];
                    let mut pa = vec![PairAcc::default(); pairs.len()];
                    let c0 = c + b * BLOCK;
                    block_pass(t, pairs, c0, c0 + BLOCK, base, &mut st, &mut pa);
                    (st, pa)
                })
                .collect();
            for (s, p) in &parts {
                merge_into(&mut self.total, s, p);
            }
            c += whole * BLOCK;
            self.pos += whole * BLOCK;
        }
        // the start of the next block
        if c < n {
            let (st, pa) = &mut self.cur;
            block_pass(t, &self.pairs, c, n, base, st, pa);
            self.pos += n - c;
        }
    }

    /// The sums of everything fed, per pair.
    pub fn partials(&self) -> Vec<Partial> {
        let mut all = self.total.clone();
        merge_into(&mut all, &self.cur.0, &self.cur.1);
        self.pairs
            .iter()
            .zip(&all.1)
            .map(|(&(i, j), acc)| Partial {
                numel: self.pos,
                stat: all.0[i],
                pair: j.map(|_| *acc),
            })
            .collect()
    }
}

fn merge_into(total: &mut (Vec<StatAcc>, Vec<PairAcc>), s: &[StatAcc], p: &[PairAcc]) {
    for (a, b) in total.0.iter_mut().zip(s) {
        a.merge(b);
    }
    for (a, b) in total.1.iter_mut().zip(p) {
        a.merge(b);
    }
}

/// Statistics of several same-length tensors and comparisons between them in one pass over
/// the data, parallel over blocks: for each `(x, reference)` of `pairs`, x's sums and, with a
/// reference, the comparison's. Sums are merged in block order, so results are deterministic.
pub fn partials(t: &[&[f32]], pairs: &[(usize, Option<usize>)]) -> Vec<Partial> {
    let mut s = Stream::new(t.len(), pairs);
    s.feed(t);
    s.partials()
}

impl Compare {
    pub fn of(x: &[f32], reference: &[f32]) -> Compare {
        assert_eq!(x.len(), reference.len(), "compare: length mismatch");
        let mut acc = PairAcc::default();
        for (i, (&a, &b)) in x.iter().zip(reference).enumerate() {
            acc.add(i, a, b);
        }
        Compare::from_sums(&acc.0)
    }

    /// The metrics from one pass's sums (shared by the CPU pass above and the GPU's fused kernel).
    pub fn from_sums(p: &PairSums) -> Compare {
        let PairSums {
            dot,
            nx,
            nr,
            ne,
            ax,
            ar,
            ..
        } = *p;
        let mut c = Compare {
            new_non_finite: p.new_non_finite,
            equal: p.equal,
            ..Default::default()
        };
        if p.any_non_finite {
            // metrics over a tensor with NaN/Inf are not meaningful; amax ratio still is for finite parts
            c.amax_ratio = if ar > 0.0 { Some(ax / ar) } else { None };
            return c;
        }
        c.cos = if ne == 0.0 {
            Some(1.0)
        } else if nx > 0.0 && nr > 0.0 {
            Some((dot / (nx * nr).sqrt()).clamp(-1.0, 1.0))
        } else if nx == 0.0 && nr == 0.0 {
            Some(1.0)
        } else {
            Some(0.0)
        };
        c.rel_l2 = if nr > 0.0 {
            Some((ne / nr).sqrt())
        } else if ne == 0.0 {
            Some(0.0)
        } else {
            None
        };
        c.sqnr_db = if ne == 0.0 {
            Some(300.0)
        } else if nr > 0.0 {
            Some((10.0 * (nr / ne).log10()).min(300.0))
        } else {
            None
        };
        if let Some((e, i)) = p.max_err {
            c.max_abs_err = Some(e);
            c.max_abs_idx = Some(i);
        }
        c.amax_ratio = if ar > 0.0 {
            Some(ax / ar)
        } else if ax == 0.0 {
            Some(1.0)
        } else {
            None
        };
        c
    }
    /// 1 − cos, the "distance" plotted and gated (∞ when undefined).
    pub fn one_minus_cos(&self) -> f64 {
        self.cos.map(|c| 1.0 - c).unwrap_or(f64::INFINITY)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_comparison_counts_the_entries_equal_to_the_references_in_pieces_too() {
        use super::*;
        // an index selection with -1 padding; NaN is never equal, +inf is
        let x = [3.0, 7.0, -1.0, -1.0, f32::NAN, f32::INFINITY, 2.0, 9.0];
        let r = [3.0, 8.0, -1.0, 5.0, f32::NAN, f32::INFINITY, 2.0, -1.0];
        assert_eq!(Compare::of(&x, &r).equal, 4);
        let pairs = [(0usize, Some(1usize))];
        let mut a = partials(&[&x[..3], &r[..3]], &pairs);
        let b = partials(&[&x[3..], &r[3..]], &pairs);
        a[0].merge_later(&b[0]);
        assert_eq!(a[0].finish().1.map(|c| c.equal), Some(4));
        // not in reports
        assert!(!serde_json::to_string(&Compare::of(&x, &r))
            .expect("json")
            .contains("equal"));
    }

    use super::*;

    /// Deterministic values of varied magnitude, never zero, with a NaN and an infinity planted.
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed;
        let mut v: Vec<f32> = (0..n)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let u = ((s >> 11) as f64 / (1u64 << 53) as f64) - 0.5;
                let e = ((s >> 3) % 40) as i32 - 20;
                let x = (u * 2f64.powi(e)) as f32;
                if x == 0.0 {
                    1e-7
                } else {
                    x
                }
            })
            .collect();
        v[n / 3] = f32::NAN;
        v[n / 2] = f32::INFINITY;
        v
    }

    fn json(p: &[Partial]) -> String {
        let f: Vec<_> = p.iter().map(Partial::finish).collect();
        format!("{f:?}")
    }

    /// A tensor fed in pieces of any size (token chunks) gives the very sums of one pass: the
    /// same bits in every statistic and comparison, the largest error at the same index.
    #[test]
    fn a_stream_fed_in_pieces_equals_one_pass_bit_for_bit() {
        let n = 3 * BLOCK + 12_345;
        let (x, r) = (values(n, 1), values(n, 2));
        // y: r and a small error (finite where r is), so the pair (y, r) has every metric
        let r: Vec<f32> = r
            .iter()
            .map(|v| if v.is_finite() { *v } else { 1.0 })
            .collect();
        let y: Vec<f32> = r
            .iter()
            .zip(&x)
            .map(|(a, b)| a + 1e-3 * b.clamp(-1.0, 1.0))
            .collect();
        let y: Vec<f32> = y
            .iter()
            .map(|v| if v.is_finite() { *v } else { 0.5 })
            .collect();
        let pairs = [(0usize, None), (1, Some(0)), (2, Some(1))];
        let whole = partials(&[&x, &r, &y], &pairs);
        for cuts in [
            vec![7usize, BLOCK - 7, 1],
            vec![BLOCK + 1, 5],
            vec![1; 3],
            vec![n / 2],
        ] {
            let mut s = Stream::new(3, &pairs);
            let mut at = 0;
            for c in cuts.iter().copied().chain(std::iter::once(n)) {
                let e = (at + c).min(n);
                s.feed(&[&x[at..e], &r[at..e], &y[at..e]]);
                at = e;
                if at == n {
                    break;
                }
            }
            assert_eq!(json(&s.partials()), json(&whole), "pieces {cuts:?}");
        }
        // merged partials of two passes: the counts and amax exactly, the largest error's index
        // moved past the first pass, the sums to rounding
        let h = n / 2;
        let mut a = partials(&[&x[..h], &r[..h], &y[..h]], &pairs);
        let b = partials(&[&x[h..], &r[h..], &y[h..]], &pairs);
        a.iter_mut().zip(&b).for_each(|(a, b)| a.merge_later(b));
        let mut checked = 0;
        for (m, w) in a.iter().zip(&whole) {
            let ((ms, mc), (ws, wc)) = (m.finish(), w.finish());
            assert_eq!(
                (ms.numel, ms.nan, ms.inf, ms.zeros),
                (ws.numel, ws.nan, ws.inf, ws.zeros)
            );
            assert_eq!(ms.amax, ws.amax);
            assert!((ms.mean_abs - ws.mean_abs).abs() <= 1e-12 * ws.mean_abs.abs());
            if let (Some(mc), Some(wc)) = (mc, wc) {
                assert_eq!(mc.max_abs_idx, wc.max_abs_idx);
                assert_eq!(mc.new_non_finite, wc.new_non_finite);
                assert_eq!(mc.equal, wc.equal);
                match (mc.rel_l2, wc.rel_l2) {
                    (Some(p), Some(q)) => assert!((p - q).abs() <= 1e-12 * q, "{p} vs {q}"),
                    (p, q) => assert_eq!(p, q),
                }
                checked += mc.rel_l2.is_some() as usize;
            }
        }
        assert_eq!(checked, 1, "the finite pair's rel-L2 was compared");
    }

    #[test]
    fn stats_counts_and_amax() {
        let s = Stats::of(&[1.0, -3.0, 0.0, f32::NAN, f32::INFINITY, 2.0]);
        assert_eq!(s.numel, 6);
        assert_eq!(s.nan, 1);
        assert_eq!(s.inf, 1);
        assert_eq!(s.zeros, 1);
        assert_eq!(s.amax, 3.0);
        assert!((s.mean_abs - 1.5).abs() < 1e-12);
    }

    #[test]
    fn compare_known_values() {
        // x = ref + e with e orthogonal-ish: ref = [3,4], x = [3,5]
        let c = Compare::of(&[3.0, 5.0], &[3.0, 4.0]);
        let cos = (9.0 + 20.0) / (34f64.sqrt() * 5.0);
        assert!((c.cos.unwrap() - cos).abs() < 1e-12);
        assert!((c.rel_l2.unwrap() - 0.2).abs() < 1e-12);
        assert!((c.sqnr_db.unwrap() - 10.0 * (25.0f64).log10()).abs() < 1e-9);
        assert_eq!(c.max_abs_idx, Some(1));
        assert!((c.amax_ratio.unwrap() - 1.25).abs() < 1e-12);
    }

    #[test]
    fn compare_identical_and_nan() {
        let c = Compare::of(&[1.0, 2.0], &[1.0, 2.0]);
        assert_eq!(c.cos, Some(1.0));
        assert_eq!(c.rel_l2, Some(0.0));
        assert_eq!(c.sqnr_db, Some(300.0));
        let n = Compare::of(&[f32::NAN, 2.0], &[1.0, 2.0]);
        assert_eq!(n.cos, None);
        assert_eq!(n.new_non_finite, 1);
    }

    #[test]
    fn compare_scaled_tensor_keeps_cosine() {
        let r: Vec<f32> = (0..100).map(|i| ((i * 37 % 17) as f32) - 8.0).collect();
        let x: Vec<f32> = r.iter().map(|v| v * 2688.0).collect();
        let c = Compare::of(&x, &r);
        assert!((c.cos.unwrap() - 1.0).abs() < 1e-12);
        assert!((c.amax_ratio.unwrap() - 2688.0).abs() < 1e-6);
    }

    #[test]
    fn fused_pass_equals_the_single_metrics() {
        // three tensors over several chunks, NaN/Inf in one, a repeated maximum error
        let n = (1 << 16) * 3 + 123;
        let r: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 37.0)
            .collect();
        let x: Vec<f32> = r
            .iter()
            .enumerate()
            .map(|(i, v)| v + (i % 13) as f32 * 1e-3)
            .collect();
        let mut y = x.clone();
        y[70_000] = f32::NAN;
        y[150_000] = f32::INFINITY;
        let t: [&[f32]; 3] = [&x, &r, &y];
        let pairs = [(0, Some(1)), (2, Some(1)), (1, None), (2, Some(0))];
        let got: Vec<_> = partials(&t, &pairs).iter().map(Partial::finish).collect();
        for ((s, c), &(i, j)) in got.iter().zip(&pairs) {
            let want = Stats::of(t[i]);
            assert_eq!(
                (s.nan, s.inf, s.zeros, s.amax),
                (want.nan, want.inf, want.zeros, want.amax)
            );
            assert!((s.mean_abs - want.mean_abs).abs() <= 1e-12 * want.mean_abs.max(1.0));
            if let Some(j) = j {
                let w = Compare::of(t[i], t[j]);
                let c = c.as_ref().expect("compare");
                assert_eq!(c.max_abs_idx, w.max_abs_idx);
                assert_eq!(c.max_abs_err, w.max_abs_err);
                assert_eq!(c.new_non_finite, w.new_non_finite);
                assert_eq!(c.amax_ratio, w.amax_ratio);
                assert_eq!(c.cos.is_some(), w.cos.is_some());
                if let (Some(a), Some(b)) = (c.rel_l2, w.rel_l2) {
                    assert!((a - b).abs() <= 1e-12 * b.max(1e-300));
                }
            } else {
                assert!(c.is_none());
            }
        }
    }
}
