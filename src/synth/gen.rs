//! Deterministic random weights. Every tensor has its own stream, seeded from (seed, canonical
//! name), so tensors can be generated in any order or in parallel — the streaming writer and the
//! in-memory one produce the same values, and a test can regenerate any one weight on its own.

use rayon::prelude::*;

use super::plan::{PKind, ParamSpec};
use crate::numerics::bf16;

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
    /// Fill with N(mean, std) (Box–Muller, both outputs used).
    pub fn fill_normal(&mut self, out: &mut [f32], mean: f32, std: f32) {
        let mut chunks = out.chunks_exact_mut(2);
        for pair in &mut chunks {
            let (a, b) = self.pair();
            pair[0] = mean + std * a;
            pair[1] = mean + std * b;
        }
        if let [last] = chunks.into_remainder() {
            *last = mean + std * self.pair().0;
        }
    }
    fn pair(&mut self) -> (f32, f32) {
        let u1 = self.uniform();
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let (s, c) = (2.0 * std::f64::consts::PI * u2).sin_cos();
        ((r * c) as f32, (r * s) as f32)
    }
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
        bf16::round_slice(row);
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
        bf16::round_slice(&mut v);
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
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
    }
}
