//! The layer search: find the faulty layer from propagated error with served-only partial runs,
//! then measure only that layer in full.
//!
//! 1. `scan`: BF16 oracle + served path (two executions per op) from the first reported layer,
//!    the served path restarted from the oracle every few layers (`ShowRule::segment_layers`) so
//!    noise cannot pile up, stopping at the first layer S whose served output is clearly broken;
//!    the oracle's state at every layer input and its layer outputs are kept.
//! 2. P(m) = "the served path started from the oracle's state at layer m's input is still broken
//!    at S's output" (by [`ShowRule::for_probes`], a little below the scan's limit). P at the
//!    start of S's segment is the scan itself; P(m) holds iff a fault lies in [m, S], so it is
//!    monotone and the faulty layer is the largest m with P(m). The search gallops down from S
//!    (S, S−1, S−2, S−4, …) and then bisects the bracket: a fault that breaks its own layer's output
//!    (the common case) costs one probe of one layer.
//! 3. The faulty layer is measured the way a run measures a reported op, resumed from the scan's
//!    states, and the first divergent op in it goes to the same hypothesis replay as the linear
//!    search (its oracle inputs come from the measurement, so no capture run is needed).
//!
//! Anything inconclusive (nothing clearly broken, or a layer that breaks the output without an op
//! that diverges in isolation) falls back to the linear search, so the layer search can cost time
//! but never a finding.

use std::time::Instant;

use super::{
    all_findings, bisect, explain_all, find_anomalies_in, lint_of, BisectResult, Cost, Phase,
    Search, SearchReport, Step,
};
use crate::checkpoint::Checkpoint;
use crate::probe::scan::{self, LayerOut, ShowRule};
use crate::probe::{RunOptions, Summary};
use crate::Result;

/// Stored weight bytes of one layer from which `auto` picks the layer search. Below it a full run
/// takes seconds and the layer search's re-reads of the faulty layer (probe, measurement) do not
/// pay for themselves; a V4-Flash layer (~3.5 GB in NVFP4) is far above it, the tiny model (~2 MB)
/// far below.
pub const AUTO_LAYER_BYTES: u64 = 256 << 20;

/// Layers a run must cover for `auto` to pick the layer search. The scan costs about half a run
/// over the layers it covers (2 of a run's ~4.3 executions per op) and is wasted when nothing
/// breaks a layer output clearly (then the linear search runs anyway); when it finds the layer, it
/// saves the run's remaining layers. On 5 layers the two balance: in the README's table 3 of 6
/// planted faults fall back (+~0.4 run each) and 3 save ~0.5 run, and on the H200 a V4-Flash
/// 5-layer bisect of an inverted activation scale took 11.4 s through the scan vs 9.7 s linear
/// (one run 5.4 s). From 8 layers on the saving of a found layer grows with the range while the
/// fallback's cost stays ~half a run.
pub const AUTO_MIN_LAYERS: usize = 8;

/// Stored bytes of the largest layer in `opts.layers` (every tensor named `layers.N.…`).
pub fn layer_bytes(ckpt: &Checkpoint, opts: &RunOptions) -> u64 {
    let (a, b) = opts.layers;
    let mut per = vec![0u64; b.saturating_sub(a) + 1];
    for name in ckpt.canonical_names() {
        let Some(rest) = name.strip_prefix("layers.") else {
            continue;
        };
        let Some(n) = rest.split('.').next().and_then(|n| n.parse::<usize>().ok()) else {
            continue;
        };
        if n < a || n > b {
            continue;
        }
        if let Some(info) = ckpt.canonical_info(&name) {
            let numel: u64 = info.shape.iter().map(|&d| d as u64).product();
            per[n - a] += numel * info.dtype.bitsize() as u64 / 8;
        }
    }
    per.into_iter().max().unwrap_or(0)
}

/// `auto`'s choice and the reason, in words.
pub fn auto_choice(ckpt: &Checkpoint, opts: &RunOptions) -> Result<(Search, String)> {
    let n = opts.layers.1.saturating_sub(opts.layers.0) + 1;
    let bytes = layer_bytes(ckpt, opts);
    let mib = bytes as f64 / (1u64 << 20) as f64;
    let lim = AUTO_LAYER_BYTES >> 20;
    Ok(if n >= AUTO_MIN_LAYERS && bytes >= AUTO_LAYER_BYTES {
        (
                Search::Layers,
                format!("auto: {n} layers of up to {mib:.0} MiB each (≥ {AUTO_MIN_LAYERS} layers and ≥ {lim} MiB per layer)"),
            )
    } else {
        (
                Search::Linear,
                format!("auto: {n} layer(s) of up to {mib:.1} MiB each (the layer search needs ≥ {AUTO_MIN_LAYERS} layers of ≥ {lim} MiB)"),
            )
    })
}

fn step_of(kind: &str, layers: (usize, usize), o: &LayerOut, execs: usize, seconds: f64) -> Step {
    Step {
        kind: kind.into(),
        layers,
        at: Some(o.id.clone()),
        rel_l2: o.vs_bf16.rel_l2,
        cos: o.vs_bf16.cos,
        broken: o.broken.clone(),
        execs,
        seconds,
    }
}

/// The layer search over `opts.layers` (falls back to the linear search when inconclusive).
pub fn layer_search(ckpt: &Checkpoint, opts: &RunOptions) -> Result<BisectResult> {
    let t0 = Instant::now();
    let rule = ShowRule::from_thresholds(&opts.spec.thresholds);
    let a = opts.layers.0;
    let mut rep = SearchReport {
        requested: Search::Layers,
        ran: Search::Layers,
        why: "requested".into(),
        fell_back: None,
        layer: None,
        steps: Vec::new(),
        phases: Vec::new(),
    };

    let sc = scan::scan(ckpt, opts, &rule, true)?;
    let last = sc.outs.last().map_or(a, |o| o.layer);
    rep.steps.push(match sc.outs.last() {
        Some(o) => step_of("scan", (a, last), o, sc.execs, sc.seconds),
        None => Step {
            kind: "scan".into(),
            layers: (a, last),
            at: None,
            rel_l2: None,
            cos: None,
            broken: None,
            execs: sc.execs,
            seconds: sc.seconds,
        },
    });
    rep.phases.push(Phase {
        name: "scan".into(),
        seconds: sc.seconds,
        execs: sc.execs,
    });
    let Some(s) = sc.broken_at else {
        return fallback(
            ckpt,
            opts,
            rep,
            t0,
            format!(
                "no layer output in {a}..{} is clearly broken (rule: {rule:?})",
                opts.layers.1
            ),
        );
    };

    // P(m): served from the oracle's state at layer m, still broken at S's output; P(seg) is the
    // scan's own segment
    let seg = sc.segment_start.unwrap_or(a);
    let reference = &sc.oracle_outs[&s];
    let (mut pe, mut ps) = (0usize, 0f64);
    let mut steps = Vec::new();
    let probe_rule = rule.for_probes();
    let mut p = |m: usize| -> Result<bool> {
        let pr = scan::served_from(
            ckpt,
            opts,
            &sc.boundaries[&m],
            (m, s),
            reference,
            &probe_rule,
        )?;
        pe += pr.execs;
        ps += pr.seconds;
        steps.push(step_of("probe", (m, s), &pr.out, pr.execs, pr.seconds));
        Ok(pr.out.broken.is_some())
    };
    let layer = last_true(seg, s, &mut p)?;
    rep.steps.append(&mut steps);
    rep.phases.push(Phase {
        name: "probes".into(),
        seconds: ps,
        execs: pe,
    });
    rep.layer = Some(layer);

    let meas = scan::measure_layer(ckpt, opts, layer, &sc.boundaries[&layer])?;
    let first = meas.records.iter().find(|r| r.divergent);
    rep.steps.push(Step {
        kind: "measure".into(),
        layers: (layer, layer),
        at: first.map(|r| r.id.clone()),
        rel_l2: first.and_then(|r| r.served_isolated_vs_bf16.rel_l2),
        cos: first.and_then(|r| r.served_isolated_vs_bf16.cos),
        broken: first.and_then(|r| r.reason.clone()),
        execs: meas.execs,
        seconds: meas.seconds,
    });
    rep.phases.push(Phase {
        name: "measure".into(),
        seconds: meas.seconds,
        execs: meas.execs,
    });
    let Some(rec) = first else {
        return fallback(
            ckpt,
            opts,
            rep,
            t0,
            format!("L{layer} breaks the output from the oracle's state, but none of its ops diverges in isolation"),
        );
    };
    let seconds_run = t0.elapsed().as_secs_f64();

    let t1 = Instant::now();
    let mut cost = Cost::default();
    let mut divs = explain_all(ckpt, opts, &meas.records, meas.captures.clone(), &mut cost)?;
    // past the measured layer the propagated picture is known at layer outputs (the scan's)
    for div in &mut divs {
        if div.shows_at_layer_out.is_none() {
            div.shows_at_layer_out = sc
                .outs
                .iter()
                .find(|o| o.layer > layer && o.shows)
                .map(|o| o.id.clone());
        }
        if div.shows_at.is_none() {
            div.shows_at = div.shows_at_layer_out.clone();
        }
    }
    let upto = sc
        .oracle_ops
        .iter()
        .position(|o| o.id == rec.id)
        .map_or(sc.oracle_ops.len(), |i| i + 1);
    let mut anomalies = find_anomalies_in(&sc.oracle_ops[..upto]);
    super::name_suspects(ckpt, &mut anomalies);
    let lint = lint_of(ckpt, opts)?;
    let findings = all_findings(&meas.records, &divs, &anomalies, &lint);
    let seconds_bisect = t1.elapsed().as_secs_f64();
    cost.phases(seconds_bisect, &mut rep.phases);

    // the measured layer's counts; the first divergence is the located op, and the error may
    // already show in an earlier layer's output (from the scan)
    let mut summary = Summary::of(&meas.records);
    summary.first_divergent = Some(rec.id.clone());
    summary.first_divergent_reason = rec.reason.clone();
    summary.first_shows = sc
        .outs
        .iter()
        .find(|o| o.layer < layer && o.shows)
        .map(|o| o.id.clone())
        .or(summary.first_shows);
    Ok(BisectResult {
        summary,
        divergence: divs.first().cloned(),
        divergences: divs,
        findings,
        anomalies,
        ops: meas.records.len(),
        seconds_run,
        seconds_bisect,
        search: rep,
    })
}

/// The largest m in [a, s] with `p(m)`, for a predicate true on [a, f] and false above, where
/// `p(a)` is known true and not evaluated. Gallops down from `s` (s, s−1, s−2, s−4, …), then bisects
/// the bracket: a fault at s costs one evaluation, any other ≤ 2·⌈log2(s−a+1)⌉ + 1.
pub fn last_true(a: usize, s: usize, p: &mut dyn FnMut(usize) -> Result<bool>) -> Result<usize> {
    // t: largest m known true; f: smallest m known false
    let (mut t, mut f) = (a, s + 1);
    let mut d = 0usize;
    loop {
        let m = s.saturating_sub(d).max(a);
        if m <= t {
            break;
        }
        if p(m)? {
            t = m;
            break;
        }
        f = m;
        d = if d == 0 { 1 } else { d * 2 };
    }
    while f - t > 1 {
        let mid = t + (f - t) / 2;
        if p(mid)? {
            t = mid;
        } else {
            f = mid;
        }
    }
    Ok(t)
}

/// The linear search after an inconclusive layer search; the search's steps and time stay in the report.
fn fallback(
    ckpt: &Checkpoint,
    opts: &RunOptions,
    mut rep: SearchReport,
    t0: Instant,
    why: String,
) -> Result<BisectResult> {
    let spent = t0.elapsed().as_secs_f64();
    let mut r = bisect(ckpt, opts)?;
    rep.ran = Search::Linear;
    rep.fell_back = Some(why);
    rep.phases.append(&mut r.search.phases);
    r.search = rep;
    r.seconds_run += spent;
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::last_true;

    /// Every fault position in ranges up to 40 layers: the right layer, within the probe bound,
    /// and never a probe of the known-true start.
    #[test]
    fn bisect_last_true_finds_every_position() {
        for a in [0usize, 3] {
            for n in 1..=40usize {
                let s = a + n - 1;
                for fault in a..=s {
                    let mut calls = Vec::new();
                    let got = last_true(a, s, &mut |m| {
                        calls.push(m);
                        Ok(m <= fault)
                    })
                    .unwrap();
                    assert_eq!(got, fault, "a {a} s {s}");
                    assert!(!calls.contains(&a), "probed the start: {calls:?}");
                    let bound = 2 * (usize::BITS - (n.max(1)).leading_zeros()) as usize + 1;
                    assert!(
                        calls.len() <= bound,
                        "{} probes > {bound}: {calls:?}",
                        calls.len()
                    );
                    if fault == s && s > a {
                        assert_eq!(calls, vec![s]);
                    }
                }
            }
        }
    }
}
