//! The GEMM of every linear on the host: exact products accumulated in f64, rounded once to f32
//! (the CUDA backend's cuBLAS DGEMM and its few-row f64 kernel give the same bits).

/// y[m, n] = Σ_k x[m, k] · w[n, k]: every product exact and the sum accumulated in f64, rounded
/// once to f32 (matrixmultiply dgemm over row blocks of w, so the f64 copy stays bounded).
///
/// Accumulating in f64 makes the result independent of the summation order to within one f32
/// rounding in about 1e-7 of the outputs, so the CPU reference and the CUDA backend (cuBLAS DGEMM
/// on the same operands) produce the same bits: with f32 accumulation their different orders
/// differ in the last f32 bit, which BF16 storage and NVFP4 re-quantization then amplify.
pub fn matmul_nt(x: &[f32], w: &[f32], m: usize, k: usize, n: usize) -> Vec<f32> {
    let mut y = vec![0f32; m * n];
    if m == 0 || n == 0 || k == 0 {
        return y;
    }
    if m <= 8 {
        // a few rows (a routed expert's tokens): dot products straight from the f32 weight,
        // parallel over output columns; no f64 copy of the weight
        use rayon::prelude::*;
        let dot = |wr: &[f32]| {
            let mut acc = [0f64; 8];
            for (r, a) in acc.iter_mut().enumerate().take(m) {
                let xr = &x[r * k..(r + 1) * k];
                // four partial sums: the f64 order does not change the rounded result
                let mut p = [0f64; 4];
                let mut it = xr.chunks_exact(4).zip(wr.chunks_exact(4));
                for (xs, ws) in &mut it {
                    for j in 0..4 {
                        p[j] += xs[j] as f64 * ws[j] as f64;
                    }
                }
                let tail = k - k % 4;
                let mut t = 0f64;
                for i in tail..k {
                    t += xr[i] as f64 * wr[i] as f64;
                }
                *a = (p[0] + p[1]) + (p[2] + p[3]) + t;
            }
            acc
        };
        let cols: Vec<[f64; 8]> = if n * k >= 1 << 20 {
            w[..n * k].par_chunks(k).map(dot).collect()
        } else {
            w[..n * k].chunks(k).map(dot).collect()
        };
        for (c, acc) in cols.iter().enumerate() {
            for r in 0..m {
                y[r * n + c] = acc[r] as f32;
            }
        }
        return y;
    }
    let xd: Vec<f64> = x[..m * k].iter().map(|&v| v as f64).collect();
    const ROWS: usize = 1024;
    let mut yd = vec![0f64; m * ROWS.min(n)];
    let mut wd: Vec<f64> = Vec::with_capacity(ROWS.min(n) * k);
    for n0 in (0..n).step_by(ROWS) {
        let c = ROWS.min(n - n0);
        wd.clear();
        wd.extend(w[n0 * k..(n0 + c) * k].iter().map(|&v| v as f64));
        unsafe {
            matrixmultiply::dgemm(
                m,
                k,
                c,
                1.0,
                xd.as_ptr(),
                k as isize,
                1,
                wd.as_ptr(),
                1,
                k as isize,
                0.0,
                yd.as_mut_ptr(),
                c as isize,
                1,
            );
        }
        for r in 0..m {
            for (o, v) in y[r * n + n0..r * n + n0 + c]
                .iter_mut()
                .zip(&yd[r * c..(r + 1) * c])
            {
                *o = *v as f32;
            }
        }
    }
    y
}
