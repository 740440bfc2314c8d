//! Per-tensor statistics and tensor-vs-reference comparisons. Metrics only read tensors.
//!
//! Everything is accumulated in f64 in one pass, so the numbers do not depend on the order the
//! backend produced the values in (within f64 rounding).

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
        let mut s = Stats {
            numel: x.len(),
            ..Default::default()
        };
        let mut sum = 0f64;
        let mut finite = 0usize;
        for &v in x {
            if v.is_nan() {
                s.nan += 1;
            } else if v.is_infinite() {
                s.inf += 1;
            } else {
                let a = v.abs() as f64;
                if a > s.amax {
                    s.amax = a;
                }
                if v == 0.0 {
                    s.zeros += 1;
                }
                sum += a;
                finite += 1;
            }
        }
        s.mean_abs = if finite > 0 { sum / finite as f64 } else { 0.0 };
        s
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
}

impl Compare {
    pub fn of(x: &[f32], reference: &[f32]) -> Compare {
        assert_eq!(x.len(), reference.len(), "compare: length mismatch");
        let (mut dot, mut nx, mut nr, mut ne) = (0f64, 0f64, 0f64, 0f64);
        let (mut ax, mut ar) = (0f64, 0f64);
        let mut max_err = -1f64;
        let mut max_idx = 0usize;
        let mut bad = false;
        let mut new_nf = 0usize;
        for (i, (&a, &b)) in x.iter().zip(reference).enumerate() {
            if !a.is_finite() || !b.is_finite() {
                bad = true;
                if !a.is_finite() && b.is_finite() {
                    new_nf += 1;
                }
                continue;
            }
            let (a, b) = (a as f64, b as f64);
            dot += a * b;
            nx += a * a;
            nr += b * b;
            let e = a - b;
            ne += e * e;
            if e.abs() > max_err {
                max_err = e.abs();
                max_idx = i;
            }
            ax = ax.max(a.abs());
            ar = ar.max(b.abs());
        }
        Compare::from_sums(&PairSums {
            dot,
            nx,
            nr,
            ne,
            ax,
            ar,
            max_err: (max_err >= 0.0).then_some((max_err, max_idx)),
            any_non_finite: bad,
            new_non_finite: new_nf,
        })
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
    use super::*;

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
}
