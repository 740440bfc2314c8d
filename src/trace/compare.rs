//! Holding an engine's op outputs against the oracle run on the same tokens, at the precision the
//! trace carries.
//!
//! Each op is held to the noise of the precision it was computed at ([`super::precision`]: the
//! coarser of the precision its values carry and the run's, read from the values whatever the
//! container): its tolerance is
//!   max(noise_multiplier × the BF16 oracle's spread vs FP32 at the op, scaled to that precision
//!       (× u_p / u_bf16), noise_multiplier × the rel-L2 one rounding to that precision puts on
//!       the op's own values, 2 × the gap our served emulation shows there, min_rel_l2).
//! The first term is the accumulated noise of a run at that precision (our BF16 oracle is one
//! such run; another implementation rounds at other points, hence the multiplier); the second is
//! the floor a run at that precision cannot go below even where our oracle computes exactly (an
//! autocast run feeds BF16 matmul outputs into its float32 mixing; our BF16 oracle keeps that part
//! exact); the third admits a quantized checkpoint's own error. An F32 trace is held to the
//! floor and the served gap. A tensor whose shape cannot be reconciled with its op is skipped
//! with the reason; the rest is compared.

use std::collections::HashMap;

use serde::Serialize;

use crate::metrics::{Compare, Stats};
use crate::probe::spec::Thresholds;
use crate::probe::RunResult;
use crate::trace::assemble::{Assembled, Mapping};
use crate::trace::precision::{self, Precision};
use crate::trace::read::TraceTokens;
use crate::{Error, Result, Tensor};

pub use crate::trace::assemble::Skipped;

/// What [`evaluate`] compared and skipped.
#[derive(Clone, Debug)]
pub struct Evaluated {
    pub ops: Vec<OpCompare>,
    pub skipped: Vec<Skipped>,
    /// The coarsest precision the run's computed outputs carry.
    pub run_precision: Precision,
}

/// Index outputs (router experts, indexer picks): fraction of per-row choices shared, order ignored.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct IndexAgreement {
    pub vs_fp32: f64,
    pub vs_bf16: f64,
    /// BF16 oracle vs FP32 oracle: how much the choice itself is numerically fragile here.
    pub noise: f64,
}

/// One trace tensor compared at one op.
#[derive(Clone, Debug, Serialize)]
pub struct OpCompare {
    pub op: String,
    /// Position of the op in execution order.
    pub step: usize,
    pub trace_name: String,
    pub dtype: String,
    pub rows: usize,
    pub stats: Stats,
    pub oracle_stats: Stats,
    pub vs_fp32: Compare,
    pub vs_bf16: Compare,
    pub vs_served: Compare,
    /// BF16 oracle vs FP32 oracle on the same rows.
    pub noise: Compare,
    pub agreement: Option<IndexAgreement>,
    /// The precision the values carry (None for index outputs).
    pub carried: Option<Precision>,
    /// The precision the op is held to: the coarser of `carried` and the run's.
    pub held_at: Option<Precision>,
    /// rel-L2 one rounding to `held_at` puts on the op's own (oracle) values.
    pub precision_floor: f64,
    pub tolerance: f64,
    /// `clean`, `divergent` or `non-finite`.
    pub verdict: String,
    pub reason: Option<String>,
    pub hint: Option<String>,
    pub notes: Vec<String>,
}

impl OpCompare {
    pub fn diverges(&self) -> bool {
        self.verdict != "clean"
    }
}

fn is_index_op(op: &str) -> bool {
    op.ends_with(".ffn.router.idx") || op.ends_with(".attn.indexer")
}

/// Ops whose outputs only copy weights (the embedding rows): they carry the weights' precision,
/// not the run's.
fn copies_weights(op: &str) -> bool {
    matches!(op, "embed" | "hc_expand")
}

/// The precision of a run from the precisions its computed outputs carry: the coarsest, FP8
/// excepted (an FP8 tensor is a quantized activation dump, not the run's arithmetic).
pub fn run_precision<'a>(carried: impl IntoIterator<Item = (&'a str, Precision)>) -> Precision {
    carried
        .into_iter()
        .filter(|(op, p)| !copies_weights(op) && !is_index_op(op) && *p != Precision::Fp8E4m3)
        .map(|(_, p)| p)
        .fold(Precision::F32, Precision::coarser)
}

fn rows_of(t: &Tensor, map: &[usize]) -> Vec<f32> {
    let r = t.shape.first().copied().unwrap_or(1).max(1);
    let w = t.numel() / r;
    map.iter()
        .flat_map(|&i| t.data[i * w..(i + 1) * w].iter().copied())
        .collect()
}

fn set_agreement(a: &[f32], b: &[f32], k: usize) -> f64 {
    if a.is_empty() || k == 0 {
        return 1.0;
    }
    let (mut same, mut total) = (0usize, 0usize);
    for (x, y) in a.chunks(k).zip(b.chunks(k)) {
        let mut xs: Vec<i64> = x.iter().map(|&v| v as i64).filter(|&v| v >= 0).collect();
        let ys: Vec<i64> = y.iter().map(|&v| v as i64).filter(|&v| v >= 0).collect();
        total += xs.len().max(ys.len());
        for v in &ys {
            if let Some(p) = xs.iter().position(|u| u == v) {
                xs.swap_remove(p);
                same += 1;
            }
        }
    }
    if total == 0 {
        1.0
    } else {
        same as f64 / total as f64
    }
}

/// Reorder each row's top-k weights by ascending expert id, so engines that list the same experts in
/// another order compare equal.
fn sort_by_idx(w: &[f32], idx: &[f32], k: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(w.len());
    for (wr, ir) in w.chunks(k).zip(idx.chunks(k)) {
        let mut p: Vec<(f32, f32)> = ir.iter().copied().zip(wr.iter().copied()).collect();
        p.sort_by(|a, b| a.0.total_cmp(&b.0));
        out.extend(p.into_iter().map(|(_, v)| v));
    }
    out
}

/// Context for the evaluation.
pub struct Inputs<'a> {
    pub res: &'a RunResult,
    pub mapping: &'a Mapping,
    pub tokens: Option<&'a TraceTokens>,
    pub rows: Option<&'a [usize]>,
    pub thresholds: &'a Thresholds,
    /// The file to name when a tensor's shape cannot be reconciled.
    pub trace_path: &'a std::path::Path,
    /// Op ids in execution order.
    pub order: &'a [String],
}

/// Which oracle rows the trace's rows are, for a token-row tensor of `len` values.
fn row_map(
    inp: &Inputs,
    a: &Assembled,
    oracle: &Tensor,
    len: usize,
) -> std::result::Result<(Vec<usize>, usize), String> {
    let t = oracle.shape.first().copied().unwrap_or(1).max(1);
    let w = oracle.numel() / t;
    let bad = |msg: String| msg;
    if w == 0 || !len.is_multiple_of(w) {
        return Err(bad(format!(
            "{len} values do not make rows of op {} (row width {w}, oracle shape {:?})",
            a.op, oracle.shape
        )));
    }
    let n = len / w;
    let full: Vec<usize> = match inp.tokens {
        Some(tk) if tk.order.len() == t => tk.order.clone(),
        _ => (0..t).collect(),
    };
    if let Some(rows) = inp.rows {
        if n == rows.len() {
            if let Some(&r) = rows.iter().find(|&&r| r >= t) {
                return Err(bad(format!("metadata row {r} is outside the {t} tokens")));
            }
            return Ok((rows.to_vec(), w));
        }
    }
    if n >= t {
        // rows past T are batch padding
        return Ok((full, w));
    }
    Err(bad(format!(
        "{n} rows of width {w} for op {} with {t} tokens{}",
        a.op,
        inp.rows
            .map(|r| format!(" ({} rows kept by metadata)", r.len()))
            .unwrap_or_default()
    )))
}

/// Compare every assembled op; a tensor whose shape cannot be reconciled with its op, or that maps
/// to an op the graph does not produce, is skipped with the reason. An error only when nothing can
/// be compared.
pub fn evaluate(inp: &Inputs) -> Result<Evaluated> {
    let get = |path: &str| -> HashMap<&str, &Tensor> {
        inp.res
            .outputs
            .get(path)
            .map(|v| v.iter().map(|(id, t)| (id.as_str(), t)).collect())
            .unwrap_or_default()
    };
    let (fp, bf, sv) = (get("oracle_fp32"), get("oracle_bf16"), get("served"));
    let th = inp.thresholds;
    let step_of: HashMap<&str, usize> = inp
        .order
        .iter()
        .enumerate()
        .map(|(i, s)| (s.as_str(), i))
        .collect();
    let trace_idx: HashMap<&str, &Assembled> = inp
        .mapping
        .ops
        .iter()
        .filter(|a| a.op.ends_with(".ffn.router.idx"))
        .map(|a| (a.op.as_str(), a))
        .collect();
    let mut out = Vec::new();
    let mut skipped = inp.mapping.skipped.clone();
    let carried: Vec<Option<Precision>> = inp
        .mapping
        .ops
        .iter()
        .map(|a| (!is_index_op(&a.op)).then(|| precision::carried(&a.data, &a.dtype)))
        .collect();
    // the run's precision from every tensor of the trace, not only the mapped ones (plus what
    // was assembled from them, e.g. a recombined layer output)
    let run_p = run_precision(
        inp.mapping
            .carried
            .iter()
            .map(|(op, p)| (op.as_str(), *p))
            .chain(
                inp.mapping
                    .ops
                    .iter()
                    .zip(&carried)
                    .filter_map(|(a, p)| Some((a.op.as_str(), (*p)?))),
            ),
    );
    for (a, own_p) in inp.mapping.ops.iter().zip(carried) {
        let skip = |reason: String| Skipped {
            trace_name: a.source.clone(),
            op: a.op.clone(),
            reason,
        };
        let (Some(f), Some(b), Some(s)) = (
            fp.get(a.op.as_str()),
            bf.get(a.op.as_str()),
            sv.get(a.op.as_str()),
        ) else {
            skipped.push(skip(format!(
                "maps to op `{}`, which this model's graph does not produce (check --names or the map file)",
                a.op
            )));
            continue;
        };
        let (mut t, mut fr, mut br, mut sr, rows) = if a.token_rows {
            let (map, w) = match row_map(inp, a, f, a.data.len()) {
                Ok(x) => x,
                Err(reason) => {
                    skipped.push(skip(reason));
                    continue;
                }
            };
            let t = a.data[..map.len() * w].to_vec();
            (t, rows_of(f, &map), rows_of(b, &map), rows_of(s, &map), map)
        } else {
            if a.data.len() != f.numel() {
                skipped.push(skip(format!(
                    "{} values where op {} has shape {:?} ({} values)",
                    a.data.len(),
                    a.op,
                    f.shape,
                    f.numel()
                )));
                continue;
            }
            let r = f.shape.first().copied().unwrap_or(1);
            (
                a.data.to_vec(),
                f.data.to_vec(),
                b.data.to_vec(),
                s.data.to_vec(),
                (0..r).collect(),
            )
        };
        let k = f.shape.last().copied().unwrap_or(1).max(1);
        if a.op.ends_with(".ffn.router") {
            let idx_id = format!("{}.idx", a.op);
            if let (Some(ti), Some(fi), Some(bi), Some(si)) = (
                trace_idx.get(idx_id.as_str()),
                fp.get(idx_id.as_str()),
                bf.get(idx_id.as_str()),
                sv.get(idx_id.as_str()),
            ) {
                if ti.data.len() >= t.len() && ti.token_rows == a.token_rows {
                    t = sort_by_idx(&t, &ti.data[..t.len()], k);
                    fr = sort_by_idx(&fr, &rows_of(fi, &rows), k);
                    br = sort_by_idx(&br, &rows_of(bi, &rows), k);
                    sr = sort_by_idx(&sr, &rows_of(si, &rows), k);
                }
            }
        }
        let stats = Stats::of(&t);
        let oracle_stats = Stats::of(&fr);
        let vs_fp32 = Compare::of(&t, &fr);
        let vs_bf16 = Compare::of(&t, &br);
        let vs_served = Compare::of(&t, &sr);
        let noise = Compare::of(&br, &fr);
        let served_gap = Compare::of(&sr, &br).rel_l2.unwrap_or(0.0);
        let held = own_p.map(|p| {
            if p == Precision::Fp8E4m3 || copies_weights(&a.op) {
                p
            } else {
                p.coarser(run_p)
            }
        });
        let hp = held.unwrap_or(Precision::F32);
        let scale = hp.unit_roundoff() / Precision::Bf16.unit_roundoff();
        let floor = precision::rounding_rel_l2(hp, &fr);
        let tol = (th.noise_multiplier * noise.rel_l2.unwrap_or(0.0) * scale)
            .max(th.noise_multiplier * floor)
            .max(2.0 * served_gap)
            .max(th.min_rel_l2);
        let oracle_finite = !oracle_stats.non_finite() && !Stats::of(&br).non_finite();
        let mut agreement = None;
        let (verdict, reason) = if stats.non_finite() && oracle_finite {
            (
                "non-finite",
                Some(format!(
                    "{} NaN, {} Inf where the oracle has none",
                    stats.nan, stats.inf
                )),
            )
        } else if is_index_op(&a.op) {
            let ag = IndexAgreement {
                vs_fp32: set_agreement(&t, &fr, k),
                vs_bf16: set_agreement(&t, &br, k),
                noise: set_agreement(&br, &fr, k),
            };
            // the served emulation's own routing/selection drift is expected of a quantized engine
            let served_ag = set_agreement(&sr, &br, k);
            let best = ag.vs_fp32.max(ag.vs_bf16);
            let floor = ag.noise.min(served_ag) - 0.05;
            let r = (best < floor).then(|| {
                format!(
                    "agreement {best:.3} below min(the oracles' own {:.3}, the served emulation's {served_ag:.3}) − 0.05",
                    ag.noise
                )
            });
            agreement = Some(ag);
            (if r.is_some() { "divergent" } else { "clean" }, r)
        } else {
            let best = match (vs_fp32.rel_l2, vs_bf16.rel_l2) {
                (Some(x), Some(y)) => Some(x.min(y)),
                (x, y) => x.or(y),
            };
            let ratio = vs_bf16.amax_ratio;
            if let Some(e) = best.filter(|e| *e > tol) {
                (
                    "divergent",
                    Some(format!("rel-L2 {e:.3e} > tolerance {tol:.3e}")),
                )
            } else if let Some(q) = ratio.filter(|q| *q > th.amax_ratio || *q < 1.0 / th.amax_ratio)
            {
                (
                    "divergent",
                    Some(format!(
                        "amax ratio {q:.3e} outside [1/{0}, {0}]",
                        th.amax_ratio
                    )),
                )
            } else if best.is_none() && oracle_finite {
                ("divergent", Some("undefined error".into()))
            } else {
                ("clean", None)
            }
        };
        let mut hint = None;
        if verdict != "clean" && a.op.ends_with(".out") && a.token_rows {
            // an engine that keeps the residual split writes X₁ where the layer output belongs
            let x1 = a.op.replace(".out", ".attn.hc_post");
            if let Some(x) = fp.get(x1.as_str()) {
                let xr = rows_of(x, &rows);
                if xr.len() == t.len() && Compare::of(&t, &xr).rel_l2.is_some_and(|e| e <= tol) {
                    hint = Some(format!(
                        "the trace holds {x1} (X₁, the residual before the FFN-side mHC post): the engine keeps \
                         the residual split; dump the layer's :residual/:post/:comb (vllm names) so compare recombines it"
                    ));
                }
            }
        }
        out.push(OpCompare {
            step: step_of.get(a.op.as_str()).copied().unwrap_or(usize::MAX),
            op: a.op.clone(),
            trace_name: a.source.clone(),
            dtype: a.dtype.clone(),
            rows: rows.len(),
            stats,
            oracle_stats,
            vs_fp32,
            vs_bf16,
            vs_served,
            noise,
            agreement,
            carried: own_p,
            held_at: held,
            precision_floor: floor,
            tolerance: tol,
            verdict: verdict.into(),
            reason,
            hint,
            notes: a.notes.clone(),
        });
    }
    out.sort_by(|x, y| x.step.cmp(&y.step).then(x.trace_name.cmp(&y.trace_name)));
    if out.is_empty() {
        return Err(Error::bad(
            inp.trace_path,
            None,
            format!(
                "no tensor could be compared: {}",
                skipped
                    .iter()
                    .take(4)
                    .map(|k| format!("{} ({})", k.trace_name, k.reason))
                    .collect::<Vec<_>>()
                    .join("; ")
            ),
        ));
    }
    Ok(Evaluated {
        ops: out,
        skipped,
        run_precision: run_p,
    })
}

/// Scale attribution of a trace's divergent ops: bisect explains every op where the served
/// emulation diverges too ([`crate::bisect::bisect_run_from`], with the oracle views the run kept);
/// the trace's divergent ops among those get bisect's verdict. An op where the emulation agrees
/// with the oracle is the engine's own doing, not the checkpoint's: not attributed.
pub fn attributions(
    ckpt: &crate::checkpoint::Checkpoint,
    opts: &crate::probe::RunOptions,
    res: &RunResult,
    caps: Vec<crate::probe::replay::Capture>,
    divergent: &[&str],
) -> Vec<(String, String)> {
    let Ok(b) = crate::bisect::bisect_run_from(ckpt, opts, res, caps) else {
        return Vec::new();
    };
    b.divergences
        .into_iter()
        .filter(|d| divergent.contains(&d.op.as_str()))
        .filter_map(|d| Some((d.op, d.verdict?.sentence)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn index_agreement_ignores_order_and_padding() {
        // rows of k=2: same sets in another order, one -1 padding pick
        assert_eq!(
            set_agreement(&[1., 2., 3., -1.], &[2., 1., 3., -1.], 2),
            1.0
        );
        assert_eq!(set_agreement(&[1., 2., 3., 4.], &[1., 5., 3., 4.], 2), 0.75);
    }

    #[test]
    fn weights_sorted_by_expert_id() {
        let w = sort_by_idx(&[0.7, 0.3, 0.1, 0.9], &[5., 2., 0., 1.], 2);
        assert_eq!(w, vec![0.3, 0.7, 0.1, 0.9]);
    }

    #[test]
    fn run_precision_ignores_copies_indices_and_fp8() {
        use Precision::*;
        assert_eq!(
            run_precision([("embed", Bf16), ("L0.attn.hc_pre", F32)]),
            F32
        );
        assert_eq!(
            run_precision([
                ("embed", Bf16),
                ("L0.attn.q_a", Bf16),
                ("L0.attn.hc_pre", F32)
            ]),
            Bf16
        );
        assert_eq!(
            run_precision([("L0.ffn.router.idx", Bf16), ("L0.attn.kv", Fp8E4m3)]),
            F32
        );
    }
}
