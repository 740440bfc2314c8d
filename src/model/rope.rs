//! RoPE frequencies from the model's config (docs/DSV4-LAYER.md §3.4): the plain inverse
//! frequencies and YaRN's blend. The table they make (`device::ops::RopeTable`) is device math.

use super::config::Yarn;

/// YaRN correction range (lo, hi) for a rope of `dim` dims (docs/DSV4-LAYER.md §3.4):
/// lo = floor(dim·ln(L/(β_fast·2π)) / (2 ln base)), hi = ceil(dim·ln(L/(β_slow·2π)) / (2 ln base)),
/// clamped to [0, dim−1].
pub fn yarn_range(dim: usize, base: f64, y: &Yarn) -> (usize, usize) {
    let corr = |rot: f64| {
        dim as f64 * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    let lo = corr(y.beta_fast).floor().max(0.0) as usize;
    let hi = corr(y.beta_slow).ceil().max(0.0) as usize;
    (lo.min(dim - 1), hi.min(dim - 1))
}

/// The correction range as the ramp uses it: [`yarn_range`] when `truncate` (the default), else
/// transformers' unrounded bounds (`truncate: false`, gpt-oss): max(lo, 0), min(hi, dim − 1).
fn ramp_bounds(dim: usize, base: f64, y: &Yarn) -> (f64, f64) {
    if y.truncate {
        let (lo, hi) = yarn_range(dim, base, y);
        return (lo as f64, hi as f64);
    }
    let corr = |rot: f64| {
        dim as f64 * (y.original_max_position_embeddings / (rot * 2.0 * std::f64::consts::PI)).ln()
            / (2.0 * base.ln())
    };
    (
        corr(y.beta_fast).max(0.0),
        corr(y.beta_slow).min((dim - 1) as f64),
    )
}

/// Inverse frequencies of an interleaved rope of `dim` dims, computed in f32 like DeepSeek's
/// `precompute_freqs_cis` (f_i = 1 / base^(2i/dim)), with YaRN blending when given.
pub fn rope_freqs(dim: usize, base: f64, yarn: Option<&Yarn>) -> Vec<f32> {
    let half = dim / 2;
    let mut f: Vec<f32> = (0..half)
        .map(|i| 1.0f32 / (base as f32).powf((2 * i) as f32 / dim as f32))
        .collect();
    if let Some(y) = yarn {
        let (lo, mut hi) = ramp_bounds(dim, base, y);
        if lo == hi {
            hi += 0.001;
        }
        // as torch: the bounds enter the f32 ramp as f32 scalars, their span taken in f64
        let (lo32, span) = (lo as f32, (hi - lo) as f32);
        let factor = y.factor as f32;
        for (i, fi) in f.iter_mut().enumerate() {
            let ramp = ((i as f32 - lo32) / span).clamp(0.0, 1.0);
            let smooth = 1.0 - ramp;
            *fi = *fi / factor * (1.0 - smooth) + *fi * smooth;
        }
    }
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::ops::RopeTable;

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

    fn pro_yarn() -> Yarn {
        Yarn {
            factor: 16.0,
            original_max_position_embeddings: 65536.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: true,
        }
    }

    #[test]
    fn yarn_range_for_base_160000_is_15_25() {
        assert_eq!(yarn_range(64, 160000.0, &pro_yarn()), (15, 25));
    }

    #[test]
    fn yarn_freqs_blend_between_plain_and_scaled() {
        let plain = rope_freqs(64, 160000.0, None);
        let y = rope_freqs(64, 160000.0, Some(&pro_yarn()));
        // Below lo the frequency is untouched, above hi it is divided by the factor.
        assert_eq!(y[0], plain[0]);
        assert_eq!(y[15], plain[15]);
        assert!((y[31] - plain[31] / 16.0).abs() <= f32::EPSILON * plain[31]);
        // f_1 = 160000^(-1/32).
        assert!((plain[1] as f64 - 160000f64.powf(-1.0 / 32.0)).abs() < 1e-7);
        // ramp at i = 20 is 0.5.
        let mid = plain[20] * 0.5 + plain[20] / 16.0 * 0.5;
        assert!((y[20] - mid).abs() < 1e-6 * plain[20]);
    }

    /// gpt-oss's rope (head 64, base 150000, ×32 from 4096, `truncate: false`): the ramp runs
    /// between the unrounded bounds, which transformers 5.17's `_compute_yarn_parameters` gives as
    /// 8.0928… and 17.3980… (the formula restated here).
    #[test]
    fn untruncated_yarn_ramps_between_fractional_bounds() {
        let y = Yarn {
            factor: 32.0,
            original_max_position_embeddings: 4096.0,
            beta_fast: 32.0,
            beta_slow: 1.0,
            truncate: false,
        };
        let (lo, hi) = ramp_bounds(64, 150000.0, &y);
        let corr = |r: f64| {
            64.0 * (4096.0 / (r * 2.0 * std::f64::consts::PI)).ln() / (2.0 * 150000f64.ln())
        };
        assert_eq!((lo, hi), (corr(32.0), corr(1.0)));
        assert!(lo.fract() != 0.0 && hi.fract() != 0.0);
        let plain = rope_freqs(64, 150000.0, None);
        let f = rope_freqs(64, 150000.0, Some(&y));
        let t = rope_freqs(
            64,
            150000.0,
            Some(&Yarn {
                truncate: true,
                ..y.clone()
            }),
        );
        // dim 12 lies inside both ramps but at different places of them
        let ramp = ((12.0 - lo) / (hi - lo)) as f32;
        let want = plain[12] / 32.0 * ramp + plain[12] * (1.0 - ramp);
        assert!(
            (f[12] - want).abs() <= 2e-7 * plain[12],
            "{} vs {want}",
            f[12]
        );
        assert!((f[12] - t[12]).abs() > 1e-3 * plain[12]);
        assert_eq!(f[0], plain[0]);
        assert_eq!(f[31], plain[31] / 32.0);
    }

    #[test]
    fn rope_then_inverse_is_identity_and_pairs_are_interleaved() {
        let f = rope_freqs(8, 10000.0, None);
        let t = RopeTable::new(&f, 0..50);
        let v0 = lcg(4, 8);
        let mut v = v0.clone();
        t.apply(&mut v, 37, false);
        assert!(v.iter().zip(&v0).any(|(a, b)| (a - b).abs() > 1e-3));
        t.apply(&mut v, 37, true);
        for (a, b) in v.iter().zip(&v0) {
            assert!((a - b).abs() < 1e-6);
        }
        // Pair 0 rotates by angle p (f_0 = 1): (1, 0) → (cos p, sin p).
        let mut e = vec![1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0];
        t.apply(&mut e, 3, false);
        assert!((e[0] - 3f32.cos()).abs() < 1e-6 && (e[1] - 3f32.sin()).abs() < 1e-6);
    }
}
