//! Deterministic random weights. Every tensor has its own stream, seeded from (seed, canonical
//! name), so tensors can be generated in any order or in parallel — the streaming writer and the
//! in-memory one produce the same values, and a test can regenerate any one weight on its own.

use rayon::prelude::*;

use super::plan::{PKind, ParamSpec};

/// splitmix64 stream.
pub struct Stream(u64);

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Stream {
    pub fn new(seed: u64, name: &str) -> Stream {
        // FNV-1a of the name, mixed with the seed.
        let mut h: u64 = 0xCBF2_9CE4_8422_2325;
        for b in name.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01B3);
        }
        Stream(mix(h ^ mix(seed.wrapping_add(0x9E37_79B9_7F4A_7C15))))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    /// Fill with N(mean, std): inverse normal CDF of 32-bit uniforms, two per draw, through a
    /// 4096-bin interpolated quantile table (exact quantile in the two outermost bins). Box–Muller
    /// in f64 dominated build time; the interpolation error (< 1e-3 absolute) is below the BF16
    /// rounding every value gets.
    pub fn fill_normal(&mut self, out: &mut [f32], mean: f32, std: f32) {
        let t = table();
        let mut chunks = out.chunks_exact_mut(2);
        for pair in &mut chunks {
            let r = self.next_u64();
            pair[0] = mean + std * quantile(t, r as u32);
            pair[1] = mean + std * quantile(t, (r >> 32) as u32);
        }
        if let [last] = chunks.into_remainder() {
            *last = mean + std * quantile(t, self.next_u64() as u32);
        }
    }
}

const BINS_LOG2: u32 = 12;
const BINS: usize = 1 << BINS_LOG2;

fn table() -> &'static [f32; BINS + 1] {
    static T: std::sync::OnceLock<Box<[f32; BINS + 1]>> = std::sync::OnceLock::new();
    T.get_or_init(|| {
        let mut t = Box::new([0f32; BINS + 1]);
        for (i, v) in t.iter_mut().enumerate().take(BINS).skip(1) {
            *v = inv_norm_cdf(i as f64 / BINS as f64) as f32;
        }
        t
    })
}

#[inline]
fn quantile(t: &[f32; BINS + 1], x: u32) -> f32 {
    let bin = (x >> (32 - BINS_LOG2)) as usize;
    if bin == 0 || bin == BINS - 1 {
        return inv_norm_cdf(u32_unit(x)) as f32;
    }
    let frac =
        (x & ((1 << (32 - BINS_LOG2)) - 1)) as f32 * (1.0 / (1u32 << (32 - BINS_LOG2)) as f32);
    t[bin] + (t[bin + 1] - t[bin]) * frac
}

/// A 32-bit integer to (0, 1), never 0 or 1 (so tails stay finite: |x| ≤ 6.2).
#[inline]
fn u32_unit(x: u32) -> f64 {
    (x as f64 + 0.5) * (1.0 / 4294967296.0)
}

/// Acklam's rational approximation of the standard normal quantile (relative error < 1.2e-9),
/// far below the BF16 rounding every generated value gets.
#[inline]
#[allow(clippy::excessive_precision)]
pub fn inv_norm_cdf(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e+01,
        2.209460984245205e+02,
        -2.759285104469687e+02,
        1.383577518672690e+02,
        -3.066479806614716e+01,
        2.506628277459239e+00,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e+01,
        1.615858368580409e+02,
        -1.556989798598866e+02,
        6.680131188771972e+01,
        -1.328068155288572e+01,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e+00,
        -2.549732539343734e+00,
        4.374664141464968e+00,
        2.938163982698783e+00,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-03,
        3.224671290700398e-01,
        2.445134137142996e+00,
        3.754408661907416e+00,
    ];
    const LOW: f64 = 0.02425;
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < LOW {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - LOW {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// BF16 bits of a finite f32, round to nearest even (the bit trick; ~5× faster than the
/// general conversion, which also handles NaN — generated values are never NaN).
#[inline]
pub fn bf16_bits(x: f32) -> u16 {
    let b = x.to_bits();
    (b.wrapping_add(0x7FFF + ((b >> 16) & 1)) >> 16) as u16
}

/// `x` rounded to BF16 (finite inputs).
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    f32::from_bits((bf16_bits(x) as u32) << 16)
}

/// Columns of a linear that get outlier magnitude: real LLM weights have a few input channels
/// far above the rest, which is what stresses per-tensor scales.
pub const OUTLIER_COLS: usize = 2;
pub const OUTLIER_GAIN: f32 = 6.0;

/// Elements per independently seeded chunk: generation parallelises over chunks while the
/// values stay independent of the thread count.
const CHUNK: usize = 1 << 20;

/// Fill `out` with N(mean, std) from per-chunk streams of `name`.
pub fn normals(seed: u64, name: &str, out: &mut [f32], mean: f32, std: f32) {
    if out.len() <= CHUNK {
        Stream::new(seed, name).fill_normal(out, mean, std);
        return;
    }
    out.par_chunks_mut(CHUNK)
        .enumerate()
        .for_each(|(i, c)| Stream::new(seed, &format!("{name}#{i}")).fill_normal(c, mean, std));
}

/// A linear weight [out, inp], BF16-representable (so the BF16 format is exact and every
/// quantiser sees the BF16 input a real producer sees): N(0, 1/sqrt(inp)) with
/// [`OUTLIER_COLS`] input channels scaled by [`OUTLIER_GAIN`].
pub fn linear(seed: u64, base: &str, out: usize, inp: usize) -> Vec<f32> {
    let mut w = vec![0f32; out * inp];
    normals(seed, base, &mut w, 0.0, (1.0 / inp as f64).sqrt() as f32);
    let mut s = Stream::new(seed, &format!("{base}#outliers"));
    let cols: Vec<usize> = (0..OUTLIER_COLS.min(inp)).map(|_| s.below(inp)).collect();
    w.par_chunks_mut(inp.max(1)).for_each(|row| {
        for &c in &cols {
            row[c] *= OUTLIER_GAIN;
        }
        row.iter_mut().for_each(|x| *x = round_bf16(*x));
    });
    w
}

/// A non-linear parameter as f32 values (tid2eid as expert ids). BF16-stored kinds are rounded.
pub fn param(seed: u64, p: &ParamSpec, n_experts: usize) -> Vec<f32> {
    let n: usize = p.shape.iter().product();
    let mut s = Stream::new(seed, &p.name);
    let mut v = vec![0f32; n];
    let (mean, std) = match p.kind {
        PKind::Norm => (1.0, 0.1),
        PKind::Embed => (0.0, 1.0),
        PKind::HcFn => (0.0, 0.02),
        PKind::HcBase => (0.0, 0.05),
        PKind::HcScale => (1.0, 0.05),
        PKind::Sink => (0.0, 0.5),
        PKind::Ape => (0.0, 0.1),
        PKind::Bias => (0.0, 0.1),
        PKind::Tid2eid => {
            let k = *p.shape.last().unwrap_or(&1);
            let k = k.min(n_experts);
            for row in v.chunks_exact_mut(p.shape.last().copied().unwrap_or(1).max(1)) {
                let mut picked: Vec<usize> = Vec::with_capacity(k);
                while picked.len() < k {
                    let x = s.below(n_experts);
                    if !picked.contains(&x) {
                        picked.push(x);
                    }
                }
                for (o, x) in row.iter_mut().zip(&picked) {
                    *o = *x as f32;
                }
            }
            return v;
        }
    };
    normals(seed, &p.name, &mut v, mean, std);
    if p.dtype == super::plan::PDtype::Bf16 {
        v.iter_mut().for_each(|x| *x = round_bf16(*x));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::bf16;

    /// Reference quantiles from standard normal tables.
    #[test]
    fn quantiles() {
        for (p, x) in [
            (0.5, 0.0),
            (0.975, 1.959963984540054),
            (0.001, -3.090232306167814),
            (0.8413447460685429, 1.0),
            (1e-6, -4.753424308822899),
        ] {
            assert!(
                (inv_norm_cdf(p) - x).abs() < 1e-8,
                "{p}: {}",
                inv_norm_cdf(p)
            );
        }
    }

    #[test]
    #[allow(clippy::excessive_precision)]
    fn streams_are_per_name_and_normal() {
        let a = linear(7, "layers.0.attn.wq_a", 64, 256);
        let b = linear(7, "layers.0.attn.wq_a", 64, 256);
        let c = linear(7, "layers.0.attn.wkv", 64, 256);
        let d = linear(8, "layers.0.attn.wq_a", 64, 256);
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a, d);
        // Excluding the outlier columns the std is 1/16 within sampling error.
        let mut s = Stream::new(1, "x");
        let mut v = vec![0f32; 100_000];
        s.fill_normal(&mut v, 0.0, 1.0);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!(mean.abs() < 0.02, "{mean}");
        assert!((var - 1.0).abs() < 0.02, "{var}");
        assert!(a.iter().all(|x| bf16::round(*x) == *x));
        for x in [
            1.0f32, -3.3, 1e-30, 65504.0, 3.0e38, 1.00390625, 1.01171875, -0.0,
        ] {
            assert_eq!(bf16_bits(x), bf16::to_bits(x), "{x}");
        }
    }
}
