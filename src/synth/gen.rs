//! Deterministic random weights. Every tensor has its own stream, seeded from (seed, canonical
//! name), so tensors can be generated in any order or in parallel — the streaming writer and the
//! in-memory one produce the same values, and a test can regenerate any one weight on its own.

use rayon::prelude::*;

use super::plan::{role, Dims, PKind, ParamSpec, Role};

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

// ---------------------------------------------------------------------------------------------
// What makes the random model behave like a trained one.
//
// A forward through i.i.d. random weights is unlike a trained model's in two ways that decide
// how quantization error travels: (1) its router scores are random, so the top-k is separated
// from the rest by random margins and the smallest perturbation of the router input swaps
// experts; (2) every block's output is as large as the residual stream, so an error is never
// diluted. Trained models have token representations that cluster, routers whose rows point
// at those clusters (a token has clear winners), and blocks that each add a modest fraction
// of the stream. The three pieces below build exactly that, and nothing else: every linear
// keeps its Gaussian-with-outlier-columns values (the quantisers see realistic weights).

/// Share of an embedding row's energy along its token cluster's direction: tokens of one
/// cluster have embedding cosine ≈ 0.5, tokens of different clusters ≈ 0 (trained embeddings
/// cluster by meaning; 0.5 leaves each token half its own identity).
pub const CLUSTER_SHARE: f32 = 0.5;

/// The router logit a token's cluster gives its first expert, per unit alignment of the
/// router input with the cluster direction; the k chosen experts fall linearly to 85 % of it.
/// The router input is unit-RMS and aligned ≈ √CLUSTER_SHARE ≈ 0.7 with its cluster at layer 1,
/// ≈ 0.6 by layer 4 as block updates accumulate, so the chosen logits are ≈ 4–5.5 and the
/// others ≈ 0 ± 0.6 (ROUTER_NOISE plus the other clusters' rows seeing the token's own part).
/// Measured on the tiny model (tests/builtin_model.rs, 64-token prompts, 6 seeds × 3 served
/// profiles): median top-k margin 0.67–1.03 selection-key units, 36–290× the served path's
/// median change of it, and no token's experts change.
pub const ROUTER_LOGIT: f32 = 8.0;

/// Standard deviation of the router's unstructured part, in logits (every expert's logit gets
/// N(0, ROUTER_NOISE) from the token's own identity, so routing weights vary per token).
pub const ROUTER_NOISE: f32 = 0.3;

/// Gain of the attention output projection (wo_b). With it the attention block adds ≈ a
/// quarter of the residual stream (mean |wo_b output| / mean |stream| ≈ 0.27 at layer 0,
/// ≈ 0.24 at layer 4 as the stream grows), where i.i.d. N(0, 1/√in) weights add ≈ 0.35.
pub const ATTN_OUT_GAIN: f32 = 0.6;

/// Gain of the FFN output projections (routed experts' and the shared expert's w2). With it
/// the FFN block adds ≈ a quarter of the stream (0.26 at layer 0, 0.24 at layer 4), where
/// i.i.d. weights add ≈ 1.8× the stream (routed scaling 2.5 on top of the shared expert).
/// Trained pre-norm models grow their residual stream with depth and each block writes a
/// modest fraction of it; that is what dilutes a quantization error the way a real model
/// does. The gains scale magnitudes only: the relative error of every quantised format is
/// unchanged (per-tensor and per-block scales follow the magnitude).
pub const FFN_OUT_GAIN: f32 = 0.17;

/// Token clusters of a model: two per group of k experts, so every expert is among the
/// chosen of (at least) two clusters in every routed layer.
pub fn clusters(d: &Dims) -> usize {
    2 * d.experts.div_ceil(d.topk.max(1))
}

/// The cluster of a token id (a fixed hash, independent of the layer).
pub fn cluster_of(seed: u64, token: usize, n: usize) -> usize {
    (mix(mix(seed ^ 0xC1C1_5EED) ^ token as u64) % n.max(1) as u64) as usize
}

/// Unit cluster directions [n, dim], orthonormal while n ≤ dim (Gram–Schmidt in f64 on
/// Gaussian draws): a router row pointing at one cluster then gives the others nothing.
pub fn cluster_dirs(seed: u64, n: usize, dim: usize) -> Vec<f32> {
    let mut g = vec![0f32; n * dim];
    normals(seed, "embed.clusters", &mut g, 0.0, 1.0);
    let mut u: Vec<Vec<f64>> = Vec::with_capacity(n);
    for row in g.chunks_exact(dim) {
        let mut v: Vec<f64> = row.iter().map(|&x| x as f64).collect();
        if u.len() < dim {
            for b in &u {
                let p: f64 = v.iter().zip(b).map(|(a, b)| a * b).sum();
                v.iter_mut().zip(b).for_each(|(a, b)| *a -= p * b);
            }
        }
        let n2 = v.iter().map(|a| a * a).sum::<f64>().sqrt().max(1e-30);
        v.iter_mut().for_each(|a| *a /= n2);
        u.push(v);
    }
    u.into_iter().flatten().map(|x| x as f32).collect()
}

/// The embedding [vocab, dim]: each row √CLUSTER_SHARE·√dim along its cluster's direction
/// plus N(0, 1 − CLUSTER_SHARE) noise, so rows keep unit RMS like N(0, 1) rows.
fn embed(seed: u64, d: &Dims, name: &str, vocab: usize, dim: usize) -> Vec<f32> {
    let mut v = vec![0f32; vocab * dim];
    normals(seed, name, &mut v, 0.0, (1.0 - CLUSTER_SHARE).sqrt());
    let n = clusters(d);
    let u = cluster_dirs(seed, n, dim);
    let a = (CLUSTER_SHARE * dim as f32).sqrt();
    v.par_chunks_mut(dim.max(1))
        .enumerate()
        .for_each(|(t, row)| {
            let c = cluster_of(seed, t, n);
            row.iter_mut()
                .zip(&u[c * dim..(c + 1) * dim])
                .for_each(|(x, ui)| *x += a * ui);
        });
    v
}

/// The experts each cluster routes to in the router `base`, best first: two independent
/// permutations of the experts per layer, each cut into consecutive groups of k (the first
/// half of the clusters takes the first, the second half the second), so the assignment
/// differs per layer and every expert gets its share of tokens.
pub fn cluster_experts(seed: u64, d: &Dims, base: &str) -> Vec<Vec<usize>> {
    let (e, k) = (d.experts, d.topk.min(d.experts).max(1));
    let per = e.div_ceil(k);
    let perm = |tag: &str| {
        let mut s = Stream::new(seed, &format!("{base}#experts{tag}"));
        let mut p: Vec<usize> = (0..e).collect();
        for i in (1..e).rev() {
            p.swap(i, s.below(i + 1));
        }
        p
    };
    let (p0, p1) = (perm("0"), perm("1"));
    (0..clusters(d))
        .map(|c| {
            let p = if c < per { &p0 } else { &p1 };
            let o = (c % per) * k;
            (0..k).map(|j| p[(o + j) % e]).collect()
        })
        .collect()
}

/// A router weight [E, dim]: N(0, ROUTER_NOISE/√dim) (so each logit gets N(0, ROUTER_NOISE)
/// from a unit-RMS input) plus, for each cluster, ROUTER_LOGIT/√dim along the cluster's
/// direction on the rows of its experts (falling linearly to 75 % for the k-th).
fn router(seed: u64, d: &Dims, base: &str, out: usize, inp: usize) -> Vec<f32> {
    let mut w = vec![0f32; out * inp];
    let sd = (inp as f32).sqrt();
    normals(seed, base, &mut w, 0.0, ROUTER_NOISE / sd);
    let u = cluster_dirs(seed, clusters(d), inp);
    for (c, set) in cluster_experts(seed, d, base).iter().enumerate() {
        let k = set.len();
        for (j, &ex) in set.iter().enumerate().filter(|(_, &ex)| ex < out) {
            let level = ROUTER_LOGIT * (1.0 - 0.15 * j as f32 / (k.max(2) - 1) as f32) / sd;
            w[ex * inp..(ex + 1) * inp]
                .iter_mut()
                .zip(&u[c * inp..(c + 1) * inp])
                .for_each(|(x, ui)| *x += level * ui);
        }
    }
    w.iter_mut().for_each(|x| *x = round_bf16(*x));
    w
}

/// A linear weight [out, inp] of the model `d`, BF16-representable (so the BF16 format is
/// exact and every quantiser sees the BF16 input a real producer sees): routers as
/// [`router`]; everything else N(0, 1/√inp) with [`OUTLIER_COLS`] input channels scaled by
/// [`OUTLIER_GAIN`], and the block output projections (wo_b, w2 of routed and shared
/// experts) times [`ATTN_OUT_GAIN`] / [`FFN_OUT_GAIN`].
pub fn linear(seed: u64, d: &Dims, base: &str, out: usize, inp: usize) -> Vec<f32> {
    let gain = match role(base) {
        Role::Router => return router(seed, d, base, out, inp),
        Role::WoB => ATTN_OUT_GAIN,
        Role::Expert(2) | Role::Shared(2) => FFN_OUT_GAIN,
        _ => 1.0,
    };
    let mut w = vec![0f32; out * inp];
    normals(seed, base, &mut w, 0.0, gain / (inp as f64).sqrt() as f32);
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

/// A non-linear parameter of the model `d` as f32 values (tid2eid as expert ids; the
/// embedding clustered as [`embed`]). BF16-stored kinds are rounded.
pub fn param(seed: u64, d: &Dims, p: &ParamSpec) -> Vec<f32> {
    let n: usize = p.shape.iter().product();
    let n_experts = d.experts;
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
    if p.kind == PKind::Embed && p.shape.len() == 2 {
        v = embed(seed, d, &p.name, p.shape[0], p.shape[1]);
    } else {
        normals(seed, &p.name, &mut v, mean, std);
    }
    if p.dtype == super::plan::PDtype::Bf16 {
        v.par_iter_mut().for_each(|x| *x = round_bf16(*x));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::numerics::bf16;
    use crate::synth::plan::{blocks, Preset};

    fn tiny() -> Dims {
        Dims::new(Preset::Tiny, None).unwrap()
    }

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
        let t = tiny();
        let a = linear(7, &t, "layers.0.attn.wq_a", 64, 256);
        let b = linear(7, &t, "layers.0.attn.wq_a", 64, 256);
        let c = linear(7, &t, "layers.0.attn.wkv", 64, 256);
        let d = linear(8, &t, "layers.0.attn.wq_a", 64, 256);
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

    /// The output projections are the plain draw times their gain (same stream, same outlier
    /// columns): the gain changes magnitudes, not the shape of the distribution a quantiser sees.
    #[test]
    fn output_projections_are_the_plain_draw_scaled() {
        let t = tiny();
        let (o, i) = (64, 256);
        for (base, gain) in [
            ("layers.1.attn.wo_b", ATTN_OUT_GAIN),
            ("layers.1.ffn.experts.3.w2", FFN_OUT_GAIN),
            ("layers.1.ffn.shared_experts.w2", FFN_OUT_GAIN),
        ] {
            let w = linear(3, &t, base, o, i);
            let mut plain = vec![0f32; o * i];
            normals(3, base, &mut plain, 0.0, 1.0 / 16.0);
            let mut outlier_cols = std::collections::BTreeSet::new();
            for (n, (a, b)) in w.iter().zip(&plain).enumerate() {
                let r = a / b;
                // BF16 rounding: relative error ≤ 2^-8 (plus the f32 product's)
                let near = |g: f32| (r - g).abs() <= g * 4.5e-3;
                if near(gain * OUTLIER_GAIN) {
                    outlier_cols.insert(n % i);
                } else {
                    assert!(near(gain), "{base}[{n}]: {a} / {b} = {r}, gain {gain}");
                }
            }
            assert!(
                (1..=OUTLIER_COLS).contains(&outlier_cols.len()),
                "{base}: {outlier_cols:?}"
            );
        }
    }

    /// Cluster directions are orthonormal; the embedding rows have unit RMS and share ≈
    /// CLUSTER_SHARE of their energy with their cluster's direction.
    #[test]
    fn embedding_clusters() {
        let t = tiny();
        let n = clusters(&t);
        assert_eq!(n, 8);
        let u = cluster_dirs(5, n, t.hidden);
        for a in 0..n {
            for b in 0..n {
                let dot: f64 = (0..t.hidden)
                    .map(|i| u[a * t.hidden + i] as f64 * u[b * t.hidden + i] as f64)
                    .sum();
                let want = if a == b { 1.0 } else { 0.0 };
                assert!((dot - want).abs() < 1e-5, "{a}·{b} = {dot}");
            }
        }
        let p = blocks(&t)[0].params[0].clone();
        assert_eq!(p.name, "embed.weight");
        let e = param(5, &t, &p);
        let (mut share, mut ms) = (0.0f64, 0.0f64);
        for tok in 0..t.vocab {
            let row = &e[tok * t.hidden..(tok + 1) * t.hidden];
            let c = cluster_of(5, tok, n);
            let along: f64 = row
                .iter()
                .zip(&u[c * t.hidden..(c + 1) * t.hidden])
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum();
            let nn: f64 = row.iter().map(|a| (*a as f64).powi(2)).sum();
            share += along * along / nn;
            ms += nn / t.hidden as f64;
        }
        let (share, ms) = (share / t.vocab as f64, ms / t.vocab as f64);
        assert!((share - CLUSTER_SHARE as f64).abs() < 0.03, "{share}");
        assert!((ms - 1.0).abs() < 0.05, "{ms}");
        // every cluster has tokens
        let mut seen = vec![0usize; n];
        (0..t.vocab).for_each(|tok| seen[cluster_of(5, tok, n)] += 1);
        assert!(seen.iter().all(|&c| c > t.vocab / n / 2), "{seen:?}");
    }

    /// A unit-RMS input along a cluster's direction gets its cluster's experts as the router's
    /// top-k, with the logit levels the constants say; every expert is some cluster's choice.
    #[test]
    fn router_rows_point_at_their_clusters() {
        let t = tiny();
        let base = "layers.2.ffn.gate";
        let w = router(9, &t, base, t.experts, t.hidden);
        let u = cluster_dirs(9, clusters(&t), t.hidden);
        let sets = cluster_experts(9, &t, base);
        let mut used = vec![0usize; t.experts];
        let sd = (t.hidden as f32).sqrt();
        for (c, set) in sets.iter().enumerate() {
            assert_eq!(set.len(), t.topk);
            let x: Vec<f32> = u[c * t.hidden..(c + 1) * t.hidden]
                .iter()
                .map(|v| v * sd)
                .collect();
            let logits: Vec<f32> = (0..t.experts)
                .map(|e| (0..t.hidden).map(|i| w[e * t.hidden + i] * x[i]).sum())
                .collect();
            let mut order: Vec<usize> = (0..t.experts).collect();
            order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
            let mut top = order[..t.topk].to_vec();
            top.sort();
            let mut want = set.clone();
            want.sort();
            assert_eq!(top, want, "cluster {c}: {logits:?}");
            // first expert ≈ ROUTER_LOGIT, last ≈ 75 % of it, within the noise part's spread
            assert!(
                (logits[set[0]] - ROUTER_LOGIT).abs() < 4.0 * ROUTER_NOISE,
                "{logits:?}"
            );
            set.iter().for_each(|&e| used[e] += 1);
        }
        assert!(used.iter().all(|&n| n > 0), "{used:?}");
        // a different layer routes the clusters differently
        assert_ne!(sets, cluster_experts(9, &t, "layers.3.ffn.gate"));
        // flash-layer (256 experts, top-6): distinct experts per cluster, every expert chosen
        let f = Dims::new(Preset::FlashLayer, Some(4)).unwrap();
        let mut used = vec![0usize; f.experts];
        for set in cluster_experts(9, &f, "layers.3.ffn.gate") {
            let mut s = set.clone();
            s.sort();
            s.dedup();
            assert_eq!(s.len(), f.topk, "{set:?}");
            set.iter().for_each(|&e| used[e] += 1);
        }
        assert!(used.iter().all(|&n| n > 0), "{used:?}");
    }
}
