//! Small shared numeric primitives of the layer math: GEMMs on `matrixmultiply`, RMSNorm, softmax,
//! the DeepSeek-V4 RoPE tables, SiLU.
//!
//! Everything is f32 with the op order the spec (docs/DSV4-LAYER.md §3) prescribes; rounding to BF16 is
//! the caller's business (the path's store), so the same code serves the FP32 oracle and BF16 paths.

/// C[m, n] = A[m, k] · B[n, k]ᵀ for row-major contiguous A and B (the `x @ Wᵀ` of every linear).
pub fn matmul_nt(a: &[f32], m: usize, k: usize, b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    gemm(m, k, n, a, (k, 1), b, (1, k), &mut c, (n, 1), false);
    c
}

/// C[m, n] = A[m, k] · B[k, n] for row-major contiguous A and B.
pub fn matmul_nn(a: &[f32], m: usize, k: usize, b: &[f32], n: usize) -> Vec<f32> {
    let mut c = vec![0.0f32; m * n];
    gemm(m, k, n, a, (k, 1), b, (n, 1), &mut c, (n, 1), false);
    c
}

/// Bounds-checked strided `sgemm`: C (+)= A·B with A [m,k], B [k,n], C [m,n] given as (row, col)
/// strides into the slices. `accumulate` adds into C instead of overwriting it.
///
/// The bounds check makes the unsafe call sound: the largest index touched is
/// (rows−1)·rs + (cols−1)·cs for each operand.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    m: usize,
    k: usize,
    n: usize,
    a: &[f32],
    (rsa, csa): (usize, usize),
    b: &[f32],
    (rsb, csb): (usize, usize),
    c: &mut [f32],
    (rsc, csc): (usize, usize),
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for i in 0..m {
                for j in 0..n {
                    c[i * rsc + j * csc] = 0.0;
                }
            }
        }
        return;
    }
    let last = |r: usize, cc: usize, rs: usize, cs: usize| (r - 1) * rs + (cc - 1) * cs;
    assert!(last(m, k, rsa, csa) < a.len(), "gemm: A out of bounds");
    assert!(last(k, n, rsb, csb) < b.len(), "gemm: B out of bounds");
    assert!(last(m, n, rsc, csc) < c.len(), "gemm: C out of bounds");
    let beta = if accumulate { 1.0 } else { 0.0 };
    // SAFETY: all indices touched are within the slices (checked above); C does not alias A or B
    // (distinct borrows).
    unsafe {
        matrixmultiply::sgemm(
            m,
            k,
            n,
            1.0,
            a.as_ptr(),
            rsa as isize,
            csa as isize,
            b.as_ptr(),
            rsb as isize,
            csb as isize,
            beta,
            c.as_mut_ptr(),
            rsc as isize,
            csc as isize,
        );
    }
}

/// In-place RMSNorm of each row of `x` (width `cols`): x · ρ [· w] with ρ = rsqrt(mean(x²) + eps)
/// from an f64 sum of squares, rounded once (`kern::rms_inv`); the products in f32.
pub fn rmsnorm_rows(x: &mut [f32], cols: usize, w: Option<&[f32]>, eps: f32) {
    if cols == 0 {
        return;
    }
    for row in x.chunks_mut(cols) {
        let r = super::kern::rms_inv(row, eps);
        match w {
            Some(w) => row.iter_mut().zip(w).for_each(|(v, wi)| *v = *v * r * wi),
            None => row.iter_mut().for_each(|v| *v *= r),
        }
    }
}

pub use super::kern::{sigmoid, sinkhorn, softmax, softplus};

/// x · sigmoid(x) evaluated in f64 and rounded once: f32 `exp` differs between libm and CUDA
/// in the last bit, f64 evaluation rounds to the same f32 on both (the SwiGLU runs on the device
/// with the CUDA backend).
#[inline]
pub fn silu(x: f32) -> f32 {
    let d = x as f64;
    (d * (1.0 / (1.0 + (-d).exp()))) as f32
}

/// cos/sin of the rope angles for positions 0..n_pos: the angle is fp32(p)·f_i rounded to f32
/// (an f64 angle drifts visibly from DeepSeek/HF/vLLM at large positions).
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    pub fn new(freqs: &[f32], positions: impl Iterator<Item = usize>) -> Self {
        let half = freqs.len();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for p in positions {
            for f in freqs {
                let theta = p as f32 * f;
                cos.push(theta.cos());
                sin.push(theta.sin());
            }
        }
        RopeTable { half, cos, sin }
    }

    /// Rotate the interleaved pairs of `v` (length 2·half) with row `row` of the table.
    /// `inverse` uses −sin, undoing the forward rotation.
    #[inline]
    pub fn apply(&self, v: &mut [f32], row: usize, inverse: bool) {
        let c = &self.cos[row * self.half..(row + 1) * self.half];
        let s = &self.sin[row * self.half..(row + 1) * self.half];
        for i in 0..self.half {
            let (a, b) = (v[2 * i], v[2 * i + 1]);
            let si = if inverse { -s[i] } else { s[i] };
            v[2 * i] = a * c[i] - b * si;
            v[2 * i + 1] = a * si + b * c[i];
        }
    }

    /// [`RopeTable::apply`] with transformers' half-split pairing (`rotate_half`): dim i pairs
    /// with i + half. The same products and sums as rotating the interleaved pairs of the
    /// permuted dims, so the bits are those of permute → `apply` → permute back.
    #[inline]
    pub fn apply_split(&self, v: &mut [f32], row: usize) {
        let (c, s) = (
            &self.cos[row * self.half..(row + 1) * self.half],
            &self.sin[row * self.half..(row + 1) * self.half],
        );
        let (lo, hi) = v.split_at_mut(self.half);
        for i in 0..self.half {
            let (a, b) = (lo[i], hi[i]);
            lo[i] = a * c[i] - b * s[i];
            hi[i] = a * s[i] + b * c[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    #[test]
    fn matmul_nt_matches_naive_loop() {
        let (m, k, n) = (5, 7, 3);
        let a = lcg(1, m * k);
        let b = lcg(2, n * k);
        let c = matmul_nt(&a, m, k, &b, n);
        for i in 0..m {
            for j in 0..n {
                let r: f64 = (0..k)
                    .map(|t| a[i * k + t] as f64 * b[j * k + t] as f64)
                    .sum();
                assert!((c[i * n + j] as f64 - r).abs() < 1e-5);
            }
        }
        let bt: Vec<f32> = (0..k * n).map(|idx| b[(idx % n) * k + idx / n]).collect();
        assert_eq!(matmul_nn(&a, m, k, &bt, n).len(), m * n);
        let c2 = matmul_nn(&a, m, k, &bt, n);
        for (x, y) in c.iter().zip(&c2) {
            assert!((x - y).abs() < 1e-6);
        }
    }

    #[test]
    fn rmsnorm_gives_unit_rms() {
        let mut x = lcg(3, 64);
        rmsnorm_rows(&mut x, 32, None, 0.0);
        for row in x.chunks(32) {
            let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / 32.0;
            assert!((ms - 1.0).abs() < 1e-5);
        }
        // The weight multiplies after normalisation: [3, 4] → [0.6, 0.8]·rms 1/√(12.5)·… check exactly.
        let mut y = vec![3.0f32, 4.0];
        rmsnorm_rows(&mut y, 2, Some(&[2.0, 1.0]), 0.0);
        let r = 1.0 / 12.5f32.sqrt();
        assert!((y[0] - 6.0 * r).abs() < 1e-6 && (y[1] - 4.0 * r).abs() < 1e-6);
    }

    #[test]
    fn softmax_handles_neg_inf() {
        let mut r = vec![0.0, f32::NEG_INFINITY, (2.0f32).ln()];
        softmax(&mut r);
        assert!((r[0] - 1.0 / 3.0).abs() < 1e-6 && r[1] == 0.0 && (r[2] - 2.0 / 3.0).abs() < 1e-6);
        let mut z = vec![f32::NEG_INFINITY; 3];
        softmax(&mut z);
        assert_eq!(z, vec![0.0; 3]);
    }

    #[test]
    fn softplus_and_silu_values() {
        assert!((softplus(0.0) - 2f32.ln()).abs() < 1e-7);
        assert!((softplus(100.0) - 100.0).abs() < 1e-5);
        assert!(softplus(-100.0) > 0.0 && softplus(-100.0) < 1e-40);
        assert!((silu(1.0) - 1.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-7);
    }

    #[test]
    fn sinkhorn_is_doubly_stochastic() {
        let mut c = lcg(9, 16).iter().map(|v| v * 4.0).collect::<Vec<_>>();
        sinkhorn(&mut c, 4, 20, 1e-6);
        for j in 0..4 {
            let r: f32 = c[j * 4..j * 4 + 4].iter().sum();
            let col: f32 = (0..4).map(|i| c[i * 4 + j]).sum();
            assert!((r - 1.0).abs() < 1e-3, "row {j} sums to {r}");
            assert!((col - 1.0).abs() < 1e-5, "col {j} sums to {col}");
        }
        assert!(c.iter().all(|v| *v > 0.0));
    }
}
