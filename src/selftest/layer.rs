//! Self-test of the layer ops on the device (`backend::layer`, `kernels/layer.cu`) against the
//! host's `device::kern` on fresh random data: every output bit for bit, with and without the
//! path's BF16 storage rounding.

use super::{exact, Check};
use crate::backend::cuda::Gpu;
use crate::device::kern::{self, AttnDims, CmpKeys, HcParams, Scoring};
use crate::device::ops::{rmsnorm_rows, RopeTable};
use crate::model::mem_env::Rng;
use crate::model::rope::rope_freqs;
use crate::numerics::bf16;
use crate::tensor::Data;
use crate::Result;

pub(super) fn normals(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
    // never zeros: a zero draw is replaced
    (0..n)
        .map(|_| {
            let v = (rng.normal() * std) as f32;
            if v == 0.0 {
                1e-3
            } else {
                v
            }
        })
        .collect()
}

pub(super) fn rounded(mut v: Vec<f32>, round: bool) -> Vec<f32> {
    if round {
        v.iter_mut().for_each(|x| *x = bf16::round(*x));
    }
    v
}

/// Host values as tensor data (the device ops upload them on first use).
pub(super) fn dv(v: &[f32]) -> Data {
    Data::from(v.to_vec())
}

pub(super) fn tag(name: &str, round: bool) -> String {
    format!("{name}{}", if round { " (bf16 store)" } else { "" })
}

pub fn checks(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    let eps = 1e-6f32;
    for round in [false, true] {
        // ---- RMSNorm with weight ----
        let (rows, cols) = (37 * s, 1000);
        let x = normals(rng, rows * cols, 2.0);
        let w = normals(rng, cols, 1.0);
        let mut want = x.clone();
        rmsnorm_rows(&mut want, cols, Some(&w), eps);
        let got = g.rmsnorm(&dv(&x), cols, Some(&w), eps, round)?;
        out.push(exact(&tag("rmsnorm", round), &got, &rounded(want, round)));

        // ---- q path: per-head RMSNorm + RoPE ----
        let (t, h, dh, nope) = (19 * s, 4, 64, 48);
        let tab = RopeTable::new(&rope_freqs(dh - nope, 10000.0, None), 0..t);
        let q = normals(rng, t * h * dh, 3.0);
        let mut want = q.clone();
        for (p, row) in want.chunks_mut(h * dh).enumerate() {
            for head in row.chunks_mut(dh) {
                rmsnorm_rows(head, dh, None, eps);
                tab.apply(&mut head[nope..], p, false);
            }
        }
        let got = g.q_rope(&dv(&q), h, dh, nope, &tab, eps, round)?;
        out.push(exact(
            &tag("q norm + rope", round),
            &got,
            &rounded(want, round),
        ));

        // ---- inverse RoPE ----
        let mut want = q.clone();
        for (p, row) in want.chunks_mut(h * dh).enumerate() {
            for head in row.chunks_mut(dh) {
                tab.apply(&mut head[nope..], p, true);
            }
        }
        let got = g.rope(&dv(&q), h, dh, nope, &tab, true, round)?;
        out.push(exact(
            &tag("rope inverse", round),
            &got,
            &rounded(want, round),
        ));

        // ---- mHC pre / head / post ----
        let (t, hc, d) = (9 * s + 2, 4, 256);
        let mix = 2 * hc + hc * hc;
        let x = normals(rng, t * hc * d, 1.5);
        let f = normals(rng, mix * hc * d, 0.05);
        let scale = normals(rng, 3, 1.0);
        let base = normals(rng, mix, 1.0);
        let p = HcParams {
            hc,
            scale: &scale,
            base: &base,
            iters: 20,
            eps,
        };
        let mut m = crate::device::gemm::matmul_nt(&x, &f, t, hc * d, mix);
        kern::hc_scale_rows(&mut m, &x, t, mix, eps);
        let (pre, post, comb) = kern::hc_coeffs_rows(&m, &p, t);
        let want_y = rounded(kern::hc_weighted_sum(&x, &pre, t, hc, d), round);
        let (gy, gpost, gcomb) = g.hc_pre(&dv(&x), t, d, &dv(&f), &p, eps, round)?;
        out.push(exact(&tag("mhc pre: y", round), &gy, &want_y));
        out.push(exact(&tag("mhc pre: post", round), &gpost, &post));
        out.push(exact(&tag("mhc pre: sinkhorn comb", round), &gcomb, &comb));

        let fh = normals(rng, hc * hc * d, 0.05);
        let coef = |m: &[f32]| -> Vec<f32> {
            m.iter()
                .enumerate()
                .map(|(i, &v)| kern::sigmoid(v * scale[0] + base[i % hc]) + eps)
                .collect()
        };
        let mut mh = crate::device::gemm::matmul_nt(&x, &fh, t, hc * d, hc);
        kern::hc_scale_rows(&mut mh, &x, t, hc, eps);
        let want = rounded(kern::hc_weighted_sum(&x, &coef(&mh), t, hc, d), round);
        let got = g.hc_head(&dv(&x), t, d, hc, &dv(&fh), eps, coef, round)?;
        out.push(exact(&tag("mhc head", round), &got, &want));

        let y = normals(rng, t * d, 1.0);
        let want = rounded(kern::hc_post(&y, &x, &post, &comb, t, hc, d), round);
        let got = g.hc_post(&dv(&y), &dv(&x), &dv(&post), &dv(&comb), t, hc, d, round)?;
        out.push(exact(&tag("mhc post", round), &got, &want));
    }

    // ---- residual sum, hc_mult expansion, SwiGLU with the clamp: chained on the device ----
    for round in [false, true] {
        let (t, d, hc) = (11 * s + 3, 384, 4);
        let a = normals(rng, t * d, 1.0);
        let mut b = normals(rng, t * d, 1e-3);
        b[7] = f32::NAN;
        b[8] = f32::INFINITY;
        let want_sum = rounded(a.iter().zip(&b).map(|(x, y)| x + y).collect(), round);
        let sum = g.add(&dv(&a), &dv(&b), round)?;
        // the sum stays on the device and feeds the expansion (never read by the host first)
        let mut want_rep = Vec::with_capacity(t * hc * d);
        for row in want_sum.chunks(d) {
            for _ in 0..hc {
                want_rep.extend_from_slice(row);
            }
        }
        let rep = g.repeat_rows(&sum, d, hc)?;
        let untouched = !sum.on_host() && !rep.on_host();
        out.push(exact(&tag("residual sum", round), &sum, &want_sum));
        let mut c = exact(
            &tag("hc_mult expansion of a device-only tensor", round),
            &rep,
            &want_rep,
        );
        if !untouched {
            c.mismatches += 1;
            c.note = "an output was fetched to the host before it was read".into();
        }
        out.push(c);

        let limit = if round { 7.0 } else { 0.0 };
        let mut gt = normals(rng, t * d, 4.0);
        let up = normals(rng, t * d, 4.0);
        gt[3] = f32::NAN;
        let want: Vec<f32> = gt
            .iter()
            .zip(&up)
            .map(|(&x, &u)| {
                let (mut x2, mut u2) = (x, u);
                if limit > 0.0 {
                    x2 = x2.min(limit);
                    u2 = u2.clamp(-limit, limit);
                }
                crate::device::ops::silu(x2) * u2
            })
            .collect();
        let got = g.swiglu(&dv(&gt), &dv(&up), limit, round)?;
        out.push(exact(
            &format!(
                "swiglu{}",
                if limit > 0.0 {
                    " clamp 7 (bf16 store)"
                } else {
                    ""
                }
            ),
            &got,
            &rounded(want, round),
        ));
    }

    // ---- BF16 storage rounding and the BF16-exactness count on device-only values ----
    {
        let n = 5000 * s + 17;
        let x = normals(rng, n, 3.0);
        // device-only copies (never on the host until read back below)
        let dev_only = |g: &mut Gpu, v: &[f32]| -> Result<Data> {
            let b = g.input_copy(&dv(v))?;
            Ok(g.output(b, v.len(), false))
        };
        let mut xd = dev_only(g, &x)?;
        let inexact_before = x.iter().filter(|v| bf16::round(**v) != **v).count();
        let exact_before = g.bf16_exact(&xd)?;
        g.round_data(&mut xd)?;
        let rounded_x = rounded(x.clone(), true);
        let mut c = exact("bf16 rounding of device-only values", &xd, &rounded_x);
        let mut nanb = rounded_x.clone();
        nanb[1] = f32::NAN;
        let nd = dev_only(g, &nanb)?;
        let exact_nan = g.bf16_exact(&nd)?;
        // a random normal vector has inexact values; rounded ones (and NaN) are exact
        if exact_before != (inexact_before == 0) || !exact_nan {
            c.mismatches += 1;
            c.note = format!(
                "bf16-exactness count: {exact_before} for {inexact_before} inexact values, {exact_nan} after rounding with a NaN"
            );
        }
        out.push(c);
    }

    // ---- attention core: window + compressed rows, causal and with an indexer selection, and
    // a later block of queries (positions from q0, kv rows from its window's start) ----
    for (ratio, use_sel, block) in [
        (0usize, false, false),
        (4, false, false),
        (4, true, false),
        (4, true, true),
    ] {
        let (t, h, dh, win) = (70 * s + 3, 3, 96, 16);
        let n_c = t.checked_div(ratio).unwrap_or(0);
        let q = normals(rng, t * h * dh, 1.0);
        let kv = normals(rng, t * dh, 1.0);
        let cmp = normals(rng, n_c * dh, 1.0);
        let sink = normals(rng, h, 1.0);
        let kk = 5;
        let sel: Vec<f32> = (0..t * kk)
            .map(|_| {
                if rng.below(5) == 0 {
                    -1.0
                } else {
                    rng.below(n_c.max(1)) as f32
                }
            })
            .collect();
        let lists = kern::selection_lists(&sel, kk, n_c);
        let keys = CmpKeys {
            ratio,
            sel: use_sel.then_some((&lists[..], kk)),
        };
        let a = AttnDims {
            t,
            h,
            dh,
            n_c,
            win,
            scale: (dh as f64).powf(-0.5) as f32,
            q0: 0,
            kv0: 0,
        };
        let want = kern::attention_core(&q, &kv, &cmp, keys, &sink, a);
        let (got, want) = if block {
            // the device on a later block against the host's whole-prompt rows
            let q0 = t / 2 + 1;
            let kv0 = (q0 + 1).saturating_sub(win);
            let b = AttnDims {
                t: t - q0,
                q0,
                kv0,
                ..a
            };
            let bk = CmpKeys {
                ratio,
                sel: Some((&lists[q0 * kk..], kk)),
            };
            let got = g
                .attention_core(
                    &dv(&q[q0 * h * dh..]),
                    &dv(&kv[kv0 * dh..]),
                    &dv(&cmp),
                    bk,
                    &sink,
                    b,
                )?
                .map(Data::into_vec)
                .unwrap_or_default();
            (got, want[q0 * h * dh..].to_vec())
        } else {
            let got = g
                .attention_core(&dv(&q), &dv(&kv), &dv(&cmp), keys, &sink, a)?
                .map(Data::into_vec)
                .unwrap_or_default();
            (got, want)
        };
        let name = match (ratio, use_sel, block) {
            (0, _, _) => "attention core (window)",
            (_, false, _) => "attention core (window + compressed)",
            (_, true, false) => "attention core (window + indexer selection)",
            _ => "attention core (a later query block, selection)",
        };
        out.push(exact(name, &got, &want));
    }

    // ---- compressor pooling (overlapping ratio 4, plain ratio 8) and its tail ----
    for ratio in [4usize, 8] {
        let (n_c, dc) = (7 * s, 64);
        let c = if ratio == 4 { 2 } else { 1 };
        let n = n_c * ratio;
        let a = normals(rng, n * c * dc, 1.0);
        let mut gt = normals(rng, n * c * dc, 2.0);
        gt[5] = f32::NEG_INFINITY;
        let ape = normals(rng, ratio * c * dc, 0.5);
        let want = kern::compress_pool(&a, &gt, &ape, n_c, dc, ratio);
        let got = g.compress_pool(&a, &gt, &ape, n_c, dc, ratio)?;
        out.push(exact(
            &format!("compressor pooling (ratio {ratio})"),
            &got,
            &want,
        ));

        let norm = normals(rng, dc, 1.0);
        let rd = 16;
        let tab = RopeTable::new(&rope_freqs(rd, 10000.0, None), (0..n_c).map(|b| b * ratio));
        let mut w = rounded(want, true);
        rmsnorm_rows(&mut w, dc, Some(&norm), eps);
        let mut w = rounded(w, true);
        for (b, row) in w.chunks_mut(dc).enumerate() {
            tab.apply(&mut row[dc - rd..], b, false);
        }
        let w = rounded(w, true);
        let got = g.compress_tail(
            &dv(&a),
            &dv(&gt),
            &ape,
            &norm,
            n_c,
            dc,
            ratio,
            eps,
            &tab,
            true,
        )?;
        out.push(exact(
            &format!("compressor tail (ratio {ratio}, bf16 store)"),
            &got,
            &w,
        ));
    }

    // ---- indexer scores ----
    let (t, hi, di, n_c) = (20 * s, 4, 64, 9);
    let q = normals(rng, t * hi * di, 1.0);
    let ki = normals(rng, n_c * di, 1.0);
    let w = normals(rng, t * hi, 0.3);
    let want = kern::indexer_scores(&q, &ki, &w, t, hi, di, n_c);
    let got = g.indexer_scores(&q, &ki, &w, t, hi, di, n_c)?;
    out.push(exact("indexer scores", &got, &want));
    // a block of queries against the compressed rows its last query sees (how the indexer
    // scores long prompts) equals those rows and columns of the whole
    let (t0, m) = (t / 2, 6);
    let got = g.indexer_scores(
        &q[t0 * hi * di..],
        &ki[..m * di],
        &w[t0 * hi..],
        t - t0,
        hi,
        di,
        m,
    )?;
    let want: Vec<f32> = (t0..t)
        .flat_map(|ti| want[ti * n_c..ti * n_c + m].to_vec())
        .collect();
    out.push(exact(
        "indexer scores (a query block, causal columns)",
        &got,
        &want,
    ));

    // ---- router: three scoring functions, ties, a NaN logit ----
    for f in [Scoring::SqrtSoftplus, Scoring::Sigmoid, Scoring::Softmax] {
        for norm in [true, false] {
            let (t, e, k) = (33 * s, 64, 6);
            let mut l = normals(rng, t * e, 2.0);
            l[3] = l[7]; // a tie within token 0
            l[e + 11] = f32::NAN;
            let mut bias = normals(rng, e, 0.1);
            bias[3] = bias[7];
            let r = kern::Routing {
                t,
                e,
                k,
                f,
                norm,
                rs: 2.5,
            };
            let (ww, wi) = kern::route(&l, &bias, r);
            let (gw, gi) = g.route(&dv(&l), &bias, r)?;
            let name = format!("router top-k ({f:?}, norm {norm})");
            let mut c = exact(&name, &gw, &ww);
            c.mismatches += gi.iter().zip(&wi).filter(|(a, b)| a != b).count();
            out.push(c);
            // a hash router's given ids (repeats allowed), the NaN logit among them
            let ids: Vec<usize> = (0..t * k)
                .map(|i| if i == k { 11 } else { rng.below(e) })
                .collect();
            let want = kern::hash_route_weights(&l, &ids, r);
            let got = g.hash_route(&dv(&l), &ids, r)?;
            out.push(exact(
                &format!("hash router weights ({f:?}, norm {norm})"),
                &got,
                &want,
            ));
        }
    }
    Ok(())
}
