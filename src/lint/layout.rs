//! Is a block-scale buffer linear, or the 128×4 swizzled layout stored as if it were linear?
//!
//! Real weights give their block scales structure along both axes: some input channels carry
//! outliers (a column effect) and rows differ in magnitude (a row effect). In log domain that
//! structure is additive, so a two-way (row + column) fit of the scales explains a good share of
//! their variance — when they are read in the layout they were written in. A 128×4-swizzled
//! buffer read linearly scatters each true column over every fourth byte of a 32-row band, and
//! the fit collapses; unswizzling it brings the structure back. The statistic is therefore the
//! fit (R²) of the linear reading against that of the unswizzled reading: whichever explains the
//! data better is the layout. Scales without structure (i.i.d. data) give neither reading an
//! edge, and nothing is reported — such corruption needs `--reference`.
//! Shifted scale rows keep the structure intact (every row has the same outlier columns), so
//! they are invisible here too and are left to `--reference`.

use crate::numerics::swizzle;

/// Chance-adjusted R² of the additive model x[r][c] ≈ μ + a_r + b_c (0 for noise, 1 for a
/// perfect fit).
pub fn additive_r2(x: &[f64], rows: usize, cols: usize) -> f64 {
    if x.len() < rows * cols {
        return 0.0;
    }
    r2_by(rows, cols, |k| x[k])
}

/// One pass: for a complete two-way table the residual sum of squares of the additive fit is
/// SS_total − SS_rows − SS_cols (balanced ANOVA identity), so no second pass is needed.
fn r2_by(rows: usize, cols: usize, get: impl Fn(usize) -> f64) -> f64 {
    if rows < 2 || cols < 2 {
        return 0.0;
    }
    let n = (rows * cols) as f64;
    let mut rs = vec![0f64; rows];
    let mut cs = vec![0f64; cols];
    let (mut sum, mut sq) = (0f64, 0f64);
    for (r, rsum) in rs.iter_mut().enumerate() {
        for (c, csum) in cs.iter_mut().enumerate() {
            let v = get(r * cols + c);
            *rsum += v;
            *csum += v;
            sq += v * v;
        }
        sum += *rsum;
    }
    let mu = sum / n;
    let tot = sq - n * mu * mu;
    if tot <= 1e-12 * sq.max(1.0) {
        return 0.0;
    }
    let ss_rows: f64 = rs
        .iter()
        .map(|s| (s / cols as f64 - mu).powi(2))
        .sum::<f64>()
        * cols as f64;
    let ss_cols: f64 = cs
        .iter()
        .map(|s| (s / rows as f64 - mu).powi(2))
        .sum::<f64>()
        * rows as f64;
    let r2 = ((ss_rows + ss_cols) / tot).min(1.0);
    // Adjusted for the R² a row + column fit reaches on structureless data, (R+C−2)/(RC−1),
    // so that narrow tensors (few columns) do not look structured by chance.
    let null = (rows + cols - 2) as f64 / (n - 1.0);
    (r2 - null) / (1.0 - null)
}

/// Scale magnitude on a log-like axis. E4M3 and UE8M0 bytes of non-negative scales are
/// monotone in the value and (nearly) linear in its log2, so the byte is used directly.
fn level(b: u8) -> f64 {
    (b & 0x7F) as f64
}

/// The two fits of a scale buffer `[rows, cols]` (bytes, row-major as stored), over its first
/// `tiles` complete 128-row tiles. None when the shape cannot hold a swizzled buffer of the
/// same shape (fewer than 128 rows, or columns not a multiple of 4).
pub fn swizzle_fits(buf: &[u8], rows: usize, cols: usize, tiles: usize) -> Option<(f64, f64)> {
    if rows < 128 || cols < 4 || !cols.is_multiple_of(4) || buf.len() < rows * cols {
        return None;
    }
    let r = (rows / 128).min(tiles.max(1)) * 128;
    let sample = &buf[..r * cols];
    let un = swizzle::unswizzle_128x4(sample, r, cols);
    Some((
        r2_by(r, cols, |k| level(sample[k])),
        r2_by(r, cols, |k| level(un[k])),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Scales with an outlier-column and a row-magnitude effect plus deterministic noise,
    /// built here independently of any quantiser.
    fn structured(rows: usize, cols: usize) -> Vec<u8> {
        let mut v = Vec::with_capacity(rows * cols);
        let mut s: u64 = 0x1234_5678;
        for r in 0..rows {
            for c in 0..cols {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                let noise = ((s >> 33) % 5) as i32 - 2;
                let col = if c == 3 || c == 10 { 20 } else { 0 };
                let row = ((r * 7) % 9) as i32;
                v.push((48 + col + row + noise) as u8);
            }
        }
        v
    }

    #[test]
    fn r2_of_pure_additive_is_one_and_of_constant_zero() {
        let x: Vec<f64> = (0..6)
            .flat_map(|r| (0..5).map(move |c| r as f64 * 2.0 + c as f64))
            .collect();
        assert!((additive_r2(&x, 6, 5) - 1.0).abs() < 1e-12);
        // Structureless data: adjusted R² near 0.
        let mut s: u64 = 7;
        let noise: Vec<f64> = (0..256 * 8)
            .map(|_| {
                s = s
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((s >> 33) % 1000) as f64
            })
            .collect();
        assert!(additive_r2(&noise, 256, 8).abs() < 0.05);
        assert_eq!(additive_r2(&[3.0; 30], 6, 5), 0.0);
    }

    #[test]
    fn linear_reads_linear_and_swizzled_reads_swizzled() {
        let (rows, cols) = (256, 16);
        let lin = structured(rows, cols);
        let (a, b) = swizzle_fits(&lin, rows, cols, 2).unwrap();
        assert!(a > 0.8 && a > b + 0.3, "linear {a} vs unswizzled {b}");
        let sw = swizzle::swizzle_128x4(&lin, rows, cols);
        let (a, b) = swizzle_fits(&sw, rows, cols, 2).unwrap();
        assert!(b > 0.8 && b > a + 0.3, "linear {a} vs unswizzled {b}");
        assert!(swizzle_fits(&lin[..64 * 16], 64, 16, 1).is_none());
    }
}
