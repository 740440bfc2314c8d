//! What the model's output says: per position, the KL divergence between two paths' next-token
//! distributions and whether their top-1 / top-5 tokens agree. Row-local, so a run's token
//! chunks concatenate (`HeadCompare::append`) into the whole prompt's.

use rayon::prelude::*;
use serde::Serialize;

/// Tokens whose sets are compared for top-k agreement.
pub const TOP_K: usize = 5;

/// One position: KL(reference ‖ x) in nats (None when either row has NaN/Inf), top-1 equal,
/// the fraction of the reference's top-5 tokens among x's top-5, and both top-1 tokens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HeadPosition {
    pub kl: Option<f64>,
    pub top1: bool,
    pub top5: f64,
    pub token: u32,
    pub reference_token: u32,
}

/// One pair of paths over every position (`positions` in prompt order) and their summary.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct HeadCompare {
    /// Mean KL over the positions where it is defined (None when it is nowhere).
    pub kl: Option<f64>,
    pub kl_max: Option<f64>,
    /// Position of `kl_max`.
    pub kl_max_at: Option<usize>,
    /// Fraction of positions whose top-1 tokens agree.
    pub top1: f64,
    /// Mean top-5 overlap.
    pub top5: f64,
    /// Positions whose KL is undefined (NaN/Inf logits).
    pub non_finite: usize,
    /// First position whose top-1 tokens differ.
    pub first_top1_change: Option<usize>,
    #[serde(skip)]
    pub positions: Vec<HeadPosition>,
}

/// Indices of the k largest finite values, largest first (ties: lower index first), in one pass.
fn top_k(row: &[f32], k: usize) -> Vec<usize> {
    let mut best: Vec<(f32, usize)> = Vec::with_capacity(k + 1);
    for (i, &v) in row.iter().enumerate() {
        if k == 0 || !v.is_finite() || (best.len() == k && v <= best[k - 1].0) {
            continue;
        }
        // after every larger value, and after equal ones (lower index first)
        let at = best.iter().position(|&(b, _)| v > b).unwrap_or(best.len());
        best.insert(at, (v, i));
        best.truncate(k);
    }
    best.into_iter().map(|(_, i)| i).collect()
}

/// KL(p_ref ‖ p_x) of the softmaxes of two logit rows, in nats: with m the maxima and
/// S = Σ e^(v − m), KL = Σ e^(r − m_r)(r − x) / S_r − (m_r + ln S_r) + (m_x + ln S_x), one pass
/// after the maxima (None when a value is not finite).
pub fn kl_row(x: &[f32], reference: &[f32]) -> Option<f64> {
    if x.iter().chain(reference).any(|v| !v.is_finite()) {
        return None;
    }
    let mx = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let mr = reference.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let (mut sx, mut sr, mut t) = (0f64, 0f64, 0f64);
    for (&a, &b) in x.iter().zip(reference) {
        let (a, b) = (a as f64, b as f64);
        let er = (b - mr).exp();
        sx += (a - mx).exp();
        sr += er;
        t += er * (b - a);
    }
    let kl = t / sr - (mr + sr.ln()) + (mx + sx.ln());
    Some(kl.max(0.0))
}

fn position(x: &[f32], reference: &[f32]) -> HeadPosition {
    let tx = top_k(x, TOP_K);
    let tr = top_k(reference, TOP_K);
    let overlap = tr.iter().filter(|i| tx.contains(i)).count();
    HeadPosition {
        kl: kl_row(x, reference),
        top1: !tx.is_empty() && tx.first() == tr.first(),
        top5: if tr.is_empty() {
            0.0
        } else {
            overlap as f64 / tr.len() as f64
        },
        token: tx.first().map_or(u32::MAX, |&i| i as u32),
        reference_token: tr.first().map_or(u32::MAX, |&i| i as u32),
    }
}

impl HeadCompare {
    /// Logits `x` against `reference`, both [positions, vocab] row-major.
    pub fn of(x: &[f32], reference: &[f32], vocab: usize) -> HeadCompare {
        let mut h = HeadCompare::default();
        h.append(x, reference, vocab);
        h
    }

    /// Appends the positions of a later token chunk and updates the summary.
    pub fn append(&mut self, x: &[f32], reference: &[f32], vocab: usize) {
        if vocab == 0 {
            return;
        }
        let rows: Vec<HeadPosition> = x
            .par_chunks(vocab)
            .zip(reference.par_chunks(vocab))
            .map(|(a, b)| position(a, b))
            .collect();
        self.positions.extend(rows);
        self.summarize();
    }

    fn summarize(&mut self) {
        let n = self.positions.len();
        let defined: Vec<(usize, f64)> = self
            .positions
            .iter()
            .enumerate()
            .filter_map(|(i, p)| p.kl.map(|k| (i, k)))
            .collect();
        self.non_finite = n - defined.len();
        self.kl = (!defined.is_empty())
            .then(|| defined.iter().map(|(_, k)| k).sum::<f64>() / defined.len() as f64);
        let max = defined.iter().copied().max_by(|a, b| a.1.total_cmp(&b.1));
        self.kl_max = max.map(|m| m.1);
        self.kl_max_at = max.map(|m| m.0);
        let n1 = n.max(1) as f64;
        self.top1 = self.positions.iter().filter(|p| p.top1).count() as f64 / n1;
        self.top5 = self.positions.iter().map(|p| p.top5).sum::<f64>() / n1;
        self.first_top1_change = self.positions.iter().position(|p| !p.top1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kl_matches_a_hand_computed_value() {
        // p = softmax([0, ln 3]) = [1/4, 3/4]; q = softmax([0, 0]) = [1/2, 1/2]
        // KL(p‖q) = 1/4 ln(1/2) + 3/4 ln(3/2)
        let want = 0.25 * (0.5f64).ln() + 0.75 * (1.5f64).ln();
        let got = kl_row(&[0.0, 0.0], &[0.0, 3f32.ln()]).unwrap();
        assert!((got - want).abs() < 1e-7, "{got} vs {want}");
        assert_eq!(kl_row(&[1.0, 2.0], &[1.0, 2.0]), Some(0.0));
        // shift invariance: logits + c give the same distribution
        let a = kl_row(&[5.0, 6.0, 1.0], &[0.0, 1.0, -4.0]).unwrap();
        assert!(a.abs() < 1e-9, "{a}");
        assert_eq!(kl_row(&[f32::NAN, 0.0], &[0.0, 0.0]), None);
    }

    #[test]
    fn top_k_agreement_per_position() {
        let vocab = 8;
        let r: Vec<f32> = (0..vocab).map(|i| i as f32).collect(); // top1 7, top5 {7,6,5,4,3}
        let mut x = r.clone();
        x.swap(7, 6); // top1 6; top5 the same set
        let mut y = r.clone();
        y[0] = 100.0; // top1 0; top5 {0,7,6,5,4}: 4 of 5
        let rows: Vec<f32> = [r.clone(), x, y].concat();
        let refs: Vec<f32> = [r.clone(), r.clone(), r].concat();
        let h = HeadCompare::of(&rows, &refs, vocab);
        assert_eq!(h.positions.len(), 3);
        assert!(h.positions[0].top1 && !h.positions[1].top1 && !h.positions[2].top1);
        assert_eq!(h.positions[1].top5, 1.0);
        assert_eq!(h.positions[2].top5, 0.8);
        assert_eq!(h.positions[2].token, 0);
        assert_eq!(h.positions[2].reference_token, 7);
        assert!((h.top1 - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(h.first_top1_change, Some(1));
        assert_eq!(h.kl_max_at, Some(2));
        // appending chunks gives the whole prompt's answer
        let mut c = HeadCompare::default();
        c.append(&rows[..vocab], &refs[..vocab], vocab);
        c.append(&rows[vocab..], &refs[vocab..], vocab);
        assert_eq!(c, h);
    }
}
