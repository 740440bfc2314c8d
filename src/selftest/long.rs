//! Self-test of the long-prompt path on the device against the host reference, bit for bit: the
//! indexer's top-k (`indexer_topk` in kernels/layer.cu) on planted scores and as the whole
//! selection (scores and top-k, in query blocks), and the attention op over the whole prompt in
//! query chunks with its selection read from device memory (`sel_lists`, `Gpu::attention`). The
//! data are random (never zeros where a zero would hide a fault) with ties planted: equal scores,
//! ±0, NaN and ±inf, equal compressed rows, a NaN and an all-zero weight row.

use super::{exact, Check};
use crate::backend::cuda::Gpu;
use crate::device::kern::{self, AttnDims, IndexerDims};
use crate::device::ops::RopeTable;
use crate::device::{CmpRows, CpuDevice, Device};
use crate::model::mem_env::Rng;
use crate::model::rope::rope_freqs;
use crate::tensor::Data;
use crate::{Result, Tensor};

fn normals(rng: &mut Rng, n: usize, std: f64) -> Vec<f32> {
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

/// Values that exist only on the device (copied there, never on the host until read back).
fn dev_only(g: &mut Gpu, v: &[f32]) -> Result<Data> {
    let b = g.input_copy(&Data::from(v.to_vec()))?;
    Ok(g.output(b, v.len(), false))
}

/// A check that fails with `note` when `ok` is false (and passes with `cases` otherwise).
fn holds(name: &str, cases: usize, ok: bool, note: String) -> Check {
    let mut c = exact(name, &[], &[]);
    c.cases = cases;
    if !ok {
        c.mismatches = 1;
        c.note = note;
    }
    c
}

/// The host reference's storage rounding of a path.
fn store(round: bool) -> impl Fn(&mut Tensor) {
    move |t: &mut Tensor| {
        if round {
            t.round_bf16()
        }
    }
}

pub fn checks(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    topk_of_planted_scores(g, rng, s, out)?;
    indexer_selection(g, rng, s, out)?;
    attention_op(g, rng, s, out)?;
    later_chunk(g, rng, s, out)?;
    Ok(())
}

/// The top-k kernel on scores drawn half from a pool of ties (±0, NaN, ±inf, repeated values)
/// and half random, over query blocks whose causal counts run below kk, past one CUDA block of
/// threads (256) and past several; plus a row of NaN only and a row of signed zeros only.
fn topk_of_planted_scores(
    g: &mut Gpu,
    rng: &mut Rng,
    s: usize,
    out: &mut Vec<Check>,
) -> Result<()> {
    let pool = [
        0.5f32,
        -0.0,
        0.0,
        f32::NAN,
        f32::NEG_INFINITY,
        f32::INFINITY,
        -1.25,
        3.0,
        0.5,
    ];
    // (ratio, kk, t0, rows, ld): query t0 + i sees min((t0 + i + 1) / ratio, ld) rows
    for (ratio, kk, t0, rows, ld) in [
        (1usize, 37usize, 0usize, 300 * s, 300 * s),
        (1, 37, 1000, 200, 1200),
        (4, 300, 4000, 50, 1100),
    ] {
        let mut sc: Vec<f32> = (0..rows * ld)
            .map(|_| {
                if rng.below(2) == 0 {
                    pool[rng.below(pool.len())]
                } else {
                    (rng.normal() * 2.0) as f32
                }
            })
            .collect();
        let last = (rows - 1) * ld;
        sc[last..].iter_mut().for_each(|v| *v = f32::NAN);
        if rows > 1 {
            let prev = (rows - 2) * ld;
            for (j, v) in sc[prev..last].iter_mut().enumerate() {
                *v = if j % 3 == 0 { -0.0 } else { 0.0 };
            }
        }
        let n_c = ld;
        let got = g.indexer_topk_of_scores(&sc, rows, ld, t0, ratio, n_c, kk)?;
        let mut want = vec![0f32; rows * kk];
        for (i, o) in want.chunks_mut(kk).enumerate() {
            let m = ((t0 + i + 1) / ratio).min(n_c);
            kern::topk_rows(&sc[i * ld..(i + 1) * ld], m, o);
        }
        out.push(exact(
            &format!(
                "indexer top-k of planted scores (ties, ±0, NaN, ±inf; kk {kk}, up to {ld} rows)"
            ),
            &got,
            &want,
        ));
    }
    Ok(())
}

/// The whole selection on the device (scaled weights, scores and top-k per query block) against
/// `kern::indexer_topk`, with compressed keys that repeat (exact score ties), a NaN weight, an
/// all-zero weight row and an infinite query value (at queries with 225, 250 and 275 causal rows,
/// past kk = 37); in blocks of 7 queries and of the default size. The selection stays on the
/// device.
fn indexer_selection(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    let (t, hi, di, ratio, kk) = (1200 * s + 3, 4, 64, 4, 37);
    let n_c = t / ratio;
    let d = IndexerDims {
        q0: 0,
        t,
        hi,
        di,
        n_c,
        ratio,
        kk,
    };
    for pooled in [true, false] {
        let q = {
            let mut q = normals(rng, t * hi * di, 1.0);
            q[1100 * hi * di + 5] = f32::INFINITY;
            q
        };
        let ki = if pooled {
            // 11 distinct rows: every query's scores take at most 11 values
            let base = normals(rng, 11 * di, 1.0);
            (0..n_c)
                .flat_map(|_| {
                    let r = rng.below(11);
                    base[r * di..(r + 1) * di].to_vec()
                })
                .collect()
        } else {
            let mut ki = normals(rng, n_c * di, 1.0);
            for (a, b) in [(2usize, 40usize), (100, 101), (7, n_c - 1)] {
                let row = ki[a * di..(a + 1) * di].to_vec();
                ki[b * di..(b + 1) * di].copy_from_slice(&row);
            }
            ki
        };
        let mut w = normals(rng, t * hi, 0.3);
        w[900 * hi + 2] = f32::NAN;
        w[1000 * hi..1001 * hi].iter_mut().for_each(|v| *v = 0.0);
        let sc = ((di as f64).powf(-0.5) * (hi as f64).powf(-0.5)) as f32;
        let ws: Vec<f32> = w.iter().map(|v| v * sc).collect();
        let (qd, kd, wd) = (dev_only(g, &q)?, dev_only(g, &ki)?, dev_only(g, &w)?);
        let default_blas = g.attn_blas;
        for (rows, blas) in [7usize, kern::score_block_rows(n_c)]
            .into_iter()
            .flat_map(|r| [(r, true), (r, false)])
        {
            let want = kern::indexer_topk(&q, &ki, &ws, d, rows);
            g.attn_blas = blas;
            let got = g.indexer_topk(&qd, &kd, &wd, sc, d, rows);
            g.attn_blas = default_blas;
            let got = got?;
            let stayed = !got.on_host() && !qd.on_host() && !kd.on_host() && !wd.on_host();
            let mut c = exact(
                &format!(
                    "indexer selection on the device ({}; {} keys, blocks of {rows} queries)",
                    if blas {
                        "DGEMM scores"
                    } else {
                        "indexer_scores"
                    },
                    if pooled { "11 distinct" } else { "repeated" }
                ),
                &got.into_vec(),
                &want,
            );
            if !stayed {
                c.mismatches += 1;
                c.note = "a tensor was read to the host during the selection".into();
            }
            out.push(c);
        }
    }
    Ok(())
}

/// Random inputs of an attention op over a whole prompt: q [t, h·dh], kv [t, dh], the
/// compressed rows of `ratio` and a raw selection [t, kk] (about one in five entries −1, the
/// rest rows drawn with repeats), with the dims (`base` with their n_c).
struct AttnCase {
    q: Vec<f32>,
    kv: Vec<f32>,
    cmp: Vec<f32>,
    sel: Vec<f32>,
    dims: AttnDims,
}

fn attn_case(rng: &mut Rng, base: AttnDims, ratio: usize, kk: usize) -> AttnCase {
    let (t, h, dh) = (base.t, base.h, base.dh);
    let n_c = t.checked_div(ratio).unwrap_or(0);
    let q = normals(rng, t * h * dh, 1.0);
    let kv = normals(rng, t * dh, 1.0);
    let cmp = normals(rng, n_c * dh, 1.0);
    let sel = (0..t * kk)
        .map(|_| match rng.below(5) {
            0 => -1.0,
            _ => rng.below(n_c.max(1)) as f32,
        })
        .collect();
    AttnCase {
        q,
        kv,
        cmp,
        sel,
        dims: AttnDims { n_c, ..base },
    }
}

/// The whole prompt's attention dims of the self-tests (n_c set by [`attn_case`]).
fn attn_dims(t: usize, h: usize, dh: usize, win: usize) -> AttnDims {
    AttnDims {
        t,
        h,
        dh,
        n_c: 0,
        win,
        scale: (dh as f64).powf(-0.5) as f32,
        q0: 0,
        kv0: 0,
    }
}

/// The attention op over a whole prompt on the device, its inputs and its raw selection (an
/// unsorted list per query with repeats and −1 holes) only in device memory, in chunks of 1, 7,
/// 64 queries and all at once, against the host op in one call; window-only, causal compressed
/// rows and a selection, with and without the BF16 store. A bad selection entry is refused
/// with the host's message.
fn attention_op(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    let (t, h, dh, win, nope, kk) = (70 * s + 3, 3, 96, 16, 64, 5);
    let dims0 = attn_dims(t, h, dh, win);
    let tab = RopeTable::new(&rope_freqs(dh - nope, 10000.0, None), 0..t);
    let sink = normals(rng, h, 1.0);
    for (ratio, use_sel) in [(0usize, false), (4, false), (4, true)] {
        for round in [false, true] {
            let AttnCase {
                q,
                kv,
                cmp,
                sel,
                dims,
            } = attn_case(rng, dims0, ratio, kk);
            let n_c = dims.n_c;
            let host = CpuDevice::new(store(round));
            let sel_t = Tensor::new(vec![t, kk], sel.clone());
            let keys = CmpRows {
                ratio,
                sel: use_sel.then_some(&sel_t),
            };
            let (qt, kvt, ct) = (
                Tensor::new(vec![t, h * dh], q.clone()),
                Tensor::new(vec![t, dh], kv.clone()),
                Tensor::new(vec![n_c, dh], cmp.clone()),
            );
            let want = host.attention(&qt, &kvt, &ct, keys, &sink, dims, nope, &tab, t)?;
            let (qd, kvd, cd, sd) = (
                dev_only(g, &q)?,
                dev_only(g, &kv)?,
                dev_only(g, &cmp)?,
                dev_only(g, &sel)?,
            );
            let default_blas = g.attn_blas;
            for (chunk, blas) in [1usize, 7, 64, t]
                .into_iter()
                .flat_map(|c| [(c, true), (c, false)])
            {
                let sel_d = use_sel.then_some((&sd, kk));
                g.attn_blas = blas;
                let got = g.attention(
                    &qd, &kvd, &cd, ratio, sel_d, &sink, dims, nope, &tab, chunk, round,
                );
                g.attn_blas = default_blas;
                let got = got?;
                let Some(got) = got else {
                    out.push(holds(
                        "attention op on the device",
                        1,
                        false,
                        "declined (shared memory)".into(),
                    ));
                    continue;
                };
                let stayed = !got.on_host() && !sd.on_host() && !qd.on_host();
                let name = format!(
                    "attention op ({}), device-resident {} in chunks of {chunk}{}",
                    if blas { "batched DGEMM" } else { "attn_core" },
                    match (ratio, use_sel) {
                        (0, _) => "window",
                        (_, false) => "window + compressed",
                        _ => "window + raw selection",
                    },
                    if round { " (bf16 store)" } else { "" }
                );
                let mut c = exact(&name, &got.into_vec(), &want.data);
                if !stayed {
                    c.mismatches += 1;
                    c.note = "a tensor was read to the host during the op".into();
                }
                out.push(c);
            }
        }
    }
    // a selection entry that is neither −1 nor a row: refused on both, with one message
    let n_c = t / 4;
    let mut sel: Vec<f32> = (0..t * kk).map(|i| (i % n_c) as f32).collect();
    sel[3 * kk + 1] = 2.5;
    sel[9 * kk] = n_c as f32;
    let dims = AttnDims {
        t,
        h,
        dh,
        n_c,
        win,
        scale: 0.1,
        q0: 0,
        kv0: 0,
    };
    let q = normals(rng, t * h * dh, 1.0);
    let kv = normals(rng, t * dh, 1.0);
    let cmp = normals(rng, n_c * dh, 1.0);
    let sel_t = Tensor::new(vec![t, kk], sel.clone());
    let host = CpuDevice::new(store(false)).attention(
        &Tensor::new(vec![t, h * dh], q.clone()),
        &Tensor::new(vec![t, dh], kv.clone()),
        &Tensor::new(vec![n_c, dh], cmp.clone()),
        CmpRows {
            ratio: 4,
            sel: Some(&sel_t),
        },
        &sink,
        dims,
        nope,
        &tab,
        7,
    );
    let sd = dev_only(g, &sel)?;
    let dev = g.attention(
        &Data::from(q),
        &Data::from(kv),
        &Data::from(cmp),
        4,
        Some((&sd, kk)),
        &sink,
        dims,
        nope,
        &tab,
        7,
        false,
    );
    let (h_msg, d_msg) = (
        host.err().map(|e| e.to_string()),
        dev.err().map(|e| e.to_string()),
    );
    let ok = h_msg.is_some() && h_msg == d_msg;
    out.push(holds(
        "attention op refuses a bad selection entry as the host does",
        1,
        ok,
        format!("host {h_msg:?}, device {d_msg:?}"),
    ));
    Ok(())
}

/// A later token chunk on the device, as a run in chunks (`probe::chunked`) asks for it: the
/// attention's queries from position q0 with their window's kv rows from kv0 and the RoPE table of
/// their positions, and the indexer's queries [q0, q1) over the keys so far, against the rows of
/// the same queries in the host's whole-prompt results (the host op at q0 too); and the rows
/// such a run joins on the device (`Gpu::cat_spans`) against the host's concatenation.
fn later_chunk(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    let (t, h, dh, win, nope, kk) = (70 * s + 3, 3, 96, 16, 64, 5);
    let dims0 = attn_dims(t, h, dh, win);
    let freqs = rope_freqs(dh - nope, 10000.0, None);
    let sink = normals(rng, h, 1.0);
    for (ratio, use_sel) in [(0usize, false), (4, false), (4, true)] {
        let AttnCase {
            q,
            kv,
            cmp,
            sel,
            dims: whole,
        } = attn_case(rng, dims0, ratio, kk);
        let n_c = whole.n_c;
        let host = CpuDevice::new(store(true));
        let sel_t = Tensor::new(vec![t, kk], sel.clone());
        fn keys(ratio: usize, sel: Option<&Tensor>) -> CmpRows<'_> {
            CmpRows { ratio, sel }
        }
        let ct = Tensor::new(vec![n_c, dh], cmp.clone());
        let want = host.attention(
            &Tensor::new(vec![t, h * dh], q.clone()),
            &Tensor::new(vec![t, dh], kv.clone()),
            &ct,
            keys(ratio, use_sel.then_some(&sel_t)),
            &sink,
            whole,
            nope,
            &RopeTable::new(&freqs, 0..t),
            t,
        )?;
        let cd = dev_only(g, &cmp)?;
        // a chunk start off and on the ratio's multiples
        for q0 in [37usize, 40] {
            let kv0 = (q0 + 1).saturating_sub(win);
            let part = AttnDims {
                t: t - q0,
                q0,
                kv0,
                ..whole
            };
            let tab = RopeTable::new(&freqs, q0..t);
            let (qs, kvs) = (&q[q0 * h * dh..], &kv[kv0 * dh..]);
            let sel_p = Tensor::new(vec![t - q0, kk], sel[q0 * kk..].to_vec());
            let host_p = host.attention(
                &Tensor::new(vec![t - q0, h * dh], qs.to_vec()),
                &Tensor::new(vec![t - kv0, dh], kvs.to_vec()),
                &ct,
                keys(ratio, use_sel.then_some(&sel_p)),
                &sink,
                part,
                nope,
                &tab,
                7,
            )?;
            let sd = dev_only(g, &sel[q0 * kk..])?;
            let (qd, kvd) = (dev_only(g, qs)?, dev_only(g, kvs)?);
            let got = g.attention(
                &qd,
                &kvd,
                &cd,
                ratio,
                use_sel.then_some((&sd, kk)),
                &sink,
                part,
                nope,
                &tab,
                7,
                true,
            )?;
            let tail = &want.data[q0 * h * dh..];
            let name = format!(
                "attention at a later chunk (queries from {q0}, kv from {kv0}, {})",
                match (ratio, use_sel) {
                    (0, _) => "window",
                    (_, false) => "window + compressed",
                    _ => "window + selection",
                }
            );
            match got {
                Some(got) => {
                    let mut c = exact(&name, &got.into_vec(), tail);
                    if host_p.data[..] != tail[..] {
                        c.mismatches += 1;
                        c.note = "the host op at a later chunk differs from its whole-prompt rows"
                            .into();
                    }
                    out.push(c);
                }
                None => out.push(holds(&name, 1, false, "declined (shared memory)".into())),
            }
        }
    }

    // the indexer's queries of a middle and a last chunk over the keys so far
    let (t, hi, di, ratio, kk) = (1200 * s + 3, 4, 64, 4, 37);
    let n_c = t / ratio;
    let q = normals(rng, t * hi * di, 1.0);
    let ki = normals(rng, n_c * di, 1.0);
    let w = normals(rng, t * hi, 0.3);
    let sc = ((di as f64).powf(-0.5) * (hi as f64).powf(-0.5)) as f32;
    let ws: Vec<f32> = w.iter().map(|v| v * sc).collect();
    let whole = IndexerDims {
        t,
        hi,
        di,
        n_c,
        ratio,
        kk,
        q0: 0,
    };
    let want = kern::indexer_topk(&q, &ki, &ws, whole, 64);
    for (q0, q1) in [(501usize, 901usize), (600, t)] {
        let d = IndexerDims {
            t: q1 - q0,
            n_c: q1 / ratio,
            q0,
            ..whole
        };
        let (qs, ks) = (&q[q0 * hi * di..q1 * hi * di], &ki[..d.n_c * di]);
        let host_p = kern::indexer_topk(qs, ks, &ws[q0 * hi..q1 * hi], d, 7);
        let (qd, kd, wd) = (
            dev_only(g, qs)?,
            dev_only(g, ks)?,
            dev_only(g, &w[q0 * hi..q1 * hi])?,
        );
        let got = g.indexer_topk(&qd, &kd, &wd, sc, d, 7)?;
        let rows = &want[q0 * kk..q1 * kk];
        let mut c = exact(
            &format!(
                "indexer selection at a later chunk (queries {q0}..{q1}, {} keys)",
                d.n_c
            ),
            &got.into_vec(),
            rows,
        );
        if host_p[..] != rows[..] {
            c.mismatches += 1;
            c.note =
                "the host selection at a later chunk differs from its whole-prompt rows".into();
        }
        out.push(c);
    }

    // rows joined on the device: device-only and host values, an empty span
    let (a, b) = (normals(rng, 300 * 7, 1.0), normals(rng, 50 * 7, 1.0));
    let ad = dev_only(g, &a)?;
    let bd = Data::from(b.clone());
    let got = g.cat_spans(&[(&ad, 7 * 10, 7 * 200), (&bd, 0, 0), (&bd, 7 * 3, 7 * 40)])?;
    let want: Vec<f32> = a[70..70 + 1400]
        .iter()
        .chain(&b[21..21 + 280])
        .copied()
        .collect();
    out.push(exact(
        "rows joined on the device (cat_spans)",
        &got.into_vec(),
        &want,
    ));

    // earlier prefill chunks' keys read back from the FP8 KV cache (--served-chunk): rows of
    // magnitudes 1e-6 to 1e3 (a row below the 1e-4 amax floor), and a width whose quantized part
    // ends inside a 64-column group
    let cases = [
        (37usize, 512usize, 448usize, 64usize),
        (11, 200, 150, 64),
        (23, 128, 128, 128),
    ];
    for (rows, cols, nope, group) in cases {
        let mut x = normals(rng, rows * cols, 1.0);
        for (r, row) in x.chunks_mut(cols).enumerate() {
            let m = 10f32.powi(r as i32 % 10 - 6);
            row.iter_mut().for_each(|v| *v *= m);
        }
        let xd = dev_only(g, &x)?;
        let got = g.kv_cache_fp8(&xd, cols, nope, group)?;
        let want = crate::numerics::fp8_block::fake_quant_kv_cache(&x, rows, cols, nope, group);
        out.push(exact(
            &format!("FP8 cache reading ({rows} rows of {cols}, {nope} quantized per {group})"),
            &got.into_vec(),
            &want,
        ));
    }
    Ok(())
}
