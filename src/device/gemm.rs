//! The GEMM of every linear on the host: exact products accumulated in f64 in one fixed order,
//! rounded once to f32 (the CUDA backend's few-row f64 kernel sums in the same order; its cuBLAS
//! DGEMM gives the same bits but in about 1e-7 of the outputs).

/// y[m, n] = Σ_k x[m, k] · w[n, k]: every product exact and the sum accumulated in f64, rounded
/// once to f32.
///
/// Every output is summed in one order, whatever `m`: four partial sums over k ≡ 0, 1, 2, 3
/// (mod 4) in k order, then (p₀ + p₁) + (p₂ + p₃) + the sum of the last k mod 4 products — the
/// order of the CUDA backend's few-row f64 kernel. A row's values therefore do not depend on
/// how many rows are multiplied with it: a prompt run in token chunks (`--chunk`) gives the bits
/// of the whole prompt. (An f64 sum in another order differs from this one after rounding to
/// f32 in about 1e-7 of the outputs; before, more than 8 rows went through `matrixmultiply`'s
/// DGEMM, whose order differs, so a chunk of ≤ 8 tokens could differ from the whole prompt in
/// a last bit.) Accumulating in f64 keeps the result within one f32 rounding of exact, so the
/// CUDA backend's cuBLAS DGEMM (more than 8 rows) gives the same bits but in about 1e-7 of the
/// outputs.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    use rayon::prelude::*;
    let mut y = vec![0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return y;
    }
    // x widened once (exact); w's rows are widened as they are read
    let xd: Vec<f64> = x[..m * k].iter().map(|&v| v as f64).collect();
    // a tile of w's rows (output columns) of about 128 KiB stays in cache while every block of
    // x's rows passes over it
    let tile = ((1usize << 17) / (4 * k)).clamp(1, n);
    let run_tile = |c0: usize| -> Vec<f32> {
        let c1 = (c0 + tile).min(n);
        let mut out = vec![0f32; m * (c1 - c0)];
        tile_product(&xd, m, k, w, c0, c1, &mut out);
        out
    };
    let starts: Vec<usize> = (0..n).step_by(tile).collect();
    let tiles: Vec<Vec<f32>> = if m * n * k >= 1 << 20 {
        starts.par_iter().map(|&c0| run_tile(c0)).collect()
    } else {
        starts.iter().map(|&c0| run_tile(c0)).collect()
    };
    for (&c0, t) in starts.iter().zip(&tiles) {
        let tc = t.len() / m;
        for r in 0..m {
            y[r * n + c0..r * n + c0 + tc].copy_from_slice(&t[r * tc..(r + 1) * tc]);
        }
    }
    y
}

/// Rows of x multiplied together with the same rows of w.
const ROWS: usize = 4;

/// `out[r, c − c0]` = row r of `xd` (f64, `m` × `k`) · row c of `w`, for c in `c0..c1`, each in
/// [`matmul_nt`]'s order; with AVX2 where the CPU has it (the same sums, four lanes at a time:
/// the order of every sum is the code's, not the instruction set's).
fn tile_product(xd: &[f64], m: usize, k: usize, w: &[f32], c0: usize, c1: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx2") {
            // SAFETY: the CPU has AVX2 (checked just above)
            unsafe { tile_product_avx2(xd, m, k, w, c0, c1, out) };
            return;
        }
    }
    tile_product_any(xd, m, k, w, c0, c1, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn tile_product_avx2(
    xd: &[f64],
    m: usize,
    k: usize,
    w: &[f32],
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    tile_product_any(xd, m, k, w, c0, c1, out)
}

#[inline(always)]
fn tile_product_any(
    xd: &[f64],
    m: usize,
    k: usize,
    w: &[f32],
    c0: usize,
    c1: usize,
    out: &mut [f32],
) {
    let tc = c1 - c0;
    for r0 in (0..m).step_by(ROWS) {
        let rows = ROWS.min(m - r0);
        // a last block of fewer rows is padded with zero rows, so that the kernel always runs
        // over ROWS rows (fixed loops vectorize); the padded rows' sums are not written
        let pad;
        let xb: &[f64] = if rows == ROWS {
            &xd[r0 * k..(r0 + rows) * k]
        } else {
            let mut v = vec![0f64; ROWS * k];
            v[..rows * k].copy_from_slice(&xd[r0 * k..(r0 + rows) * k]);
            pad = v;
            &pad
        };
        let mut c = c0;
        while c < c1 {
            let two = c + 1 < c1;
            let wa = &w[c * k..(c + 1) * k];
            let wb = if two {
                &w[(c + 1) * k..(c + 2) * k]
            } else {
                wa
            };
            let (ya, yb) = dot_rows2(xb, rows, wa, wb, k);
            for r in 0..rows {
                out[(r0 + r) * tc + (c - c0)] = ya[r] as f32;
                if two {
                    out[(r0 + r) * tc + (c + 1 - c0)] = yb[r] as f32;
                }
            }
            c += 2;
        }
    }
}

/// The dot products of the first `rows` of the [`ROWS`] rows of `xb` (f64, `k` wide) with `wa`
/// and with `wb`, each in [`matmul_nt`]'s order (every row is summed; `rows` bounds the tails).
#[inline(always)]
fn dot_rows2(
    xb: &[f64],
    rows: usize,
    wa: &[f32],
    wb: &[f32],
    k: usize,
) -> ([f64; ROWS], [f64; ROWS]) {
    let mut pa = [[0f64; 4]; ROWS];
    let mut pb = [[0f64; 4]; ROWS];
    let k4 = k - k % 4;
    let mut i = 0;
    while i < k4 {
        let mut va = [0f64; 4];
        let mut vb = [0f64; 4];
        for j in 0..4 {
            va[j] = wa[i + j] as f64;
            vb[j] = wb[i + j] as f64;
        }
        for r in 0..ROWS {
            let xs = &xb[r * k + i..r * k + i + 4];
            for j in 0..4 {
                pa[r][j] += xs[j] * va[j];
                pb[r][j] += xs[j] * vb[j];
            }
        }
        i += 4;
    }
    let fin = |p: &[[f64; 4]; ROWS], wr: &[f32]| {
        let mut acc = [0f64; ROWS];
        for r in 0..rows {
            let mut t = 0f64;
            for i in k4..k {
                t += xb[r * k + i] * wr[i] as f64;
            }
            acc[r] = (p[r][0] + p[r][1]) + (p[r][2] + p[r][3]) + t;
        }
        acc
    };
    (fin(&pa, wa), fin(&pb, wb))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values of mixed signs and magnitudes (products that nearly cancel make
    /// the order of an f64 sum show after rounding to f32).
    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let u = (s >> 11) as f64 / (1u64 << 53) as f64;
                let e = ((s >> 3) % 12) as i32 - 6;
                ((u - 0.5) * 2f64.powi(e)) as f32
            })
            .collect()
    }

    /// The product's rows do not depend on how many rows are multiplied together: each row
    /// alone, in blocks of 5 and all 40 at once give the same bits (what makes a prompt in
    /// token chunks equal the whole prompt). Random operands rarely round differently in
    /// another order (about 1e-7 of the outputs); the next test plants a sum that does.
    #[test]
    fn rows_do_not_depend_on_how_many_are_multiplied_together() {
        for &(k, n) in &[(1027usize, 600usize), (64, 3000), (4096, 70)] {
            let m = 40;
            let x = values(m * k, k as u64);
            let w = values(n * k, n as u64 + 1);
            let all = matmul_nt(&x, &w, m, k, n);
            for chunk in [1usize, 5, 8, 9] {
                for r0 in (0..m).step_by(chunk) {
                    let rows = chunk.min(m - r0);
                    let part = matmul_nt(&x[r0 * k..(r0 + rows) * k], &w, rows, k, n);
                    let differ = part
                        .iter()
                        .zip(&all[r0 * n..(r0 + rows) * n])
                        .filter(|(a, b)| a.to_bits() != b.to_bits())
                        .count();
                    assert_eq!(differ, 0, "k {k} n {n}, rows {r0}+{rows}");
                }
            }
        }
    }

    /// A sum whose f64 rounding depends on the order, at an f32 tie: one row alone and the
    /// same row among 12 round alike, to the value of the documented order (the partial sums
    /// 2⁻⁵³ + 2⁻⁵³ survive; summed in k order each is lost against 1 + 2⁻²⁴ and the tie goes to 1).
    /// Before, 12 rows went through DGEMM's k order and gave 1.0, one row 1 + 2⁻²³.
    #[test]
    fn a_row_at_an_f32_tie_rounds_alike_alone_and_among_many() {
        let k = 5;
        let tie = [1.0f32, 2f32.powi(-24), 2f32.powi(-53), 2f32.powi(-53), 0.0];
        let mut x = values(12 * k, 3);
        x[3 * k..4 * k].copy_from_slice(&tie);
        let w = vec![1.0f32; k];
        let all = matmul_nt(&x, &w, 12, k, 1);
        let one = matmul_nt(&tie, &w, 1, k, 1);
        assert_eq!(one[0], 1.0 + 2f32.powi(-23));
        assert_eq!(all[3].to_bits(), one[0].to_bits());
    }

    /// Every output (tails of k mod 4 included) against an exact integer reference, on
    /// operands whose products and sums are exact in f64.
    #[test]
    fn the_product_equals_an_exact_reference() {
        let (m, k, n) = (3, 257, 50);
        let x: Vec<f32> = values(m * k, 7)
            .iter()
            .map(|v| (v * 64.0).round() / 64.0)
            .collect();
        let w: Vec<f32> = values(n * k, 8)
            .iter()
            .map(|v| (v * 64.0).round() / 64.0)
            .collect();
        let y = matmul_nt(&x, &w, m, k, n);
        for r in 0..m {
            for c in 0..n {
                // the operands are multiples of 1/64 below 32: the products are exact in i64
                let exact: i64 = (0..k)
                    .map(|i| (x[r * k + i] * 64.0) as i64 * (w[c * k + i] * 64.0) as i64)
                    .sum();
                let want = (exact as f64 / 4096.0) as f32;
                assert_eq!(y[r * n + c], want, "({r}, {c})");
            }
        }
    }
}
