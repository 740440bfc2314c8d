//! The layer search (`--search layers`) against the linear search on the tiny model: the same op
//! and verdict, nothing on clean checkpoints, fewer op executions, and the one-layer measurement
//! equal to a full run's records of that layer.

use nvfp4_probe::bisect::{self, BisectResult, Search};
use nvfp4_probe::checkpoint::{Checkpoint, Naming};
use nvfp4_probe::probe::scan::{self, ShowRule};
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions};
use nvfp4_probe::served::faults::{Fault, FaultKind};
use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};
use rayon::prelude::*;

const T: usize = 32;

fn opts(last: usize, faults: Vec<Fault>, tseed: u64) -> RunOptions {
    RunOptions {
        loader_faults: faults,
        ..RunOptions::new((0, last), synthetic_tokens(T, 512, tseed))
    }
}

fn ckpt(format: Format, seed: u64) -> Checkpoint {
    synth::synth_to_memory(&SynthOptions::new(
        Preset::Tiny,
        format,
        Naming::Official,
        seed,
    ))
    .unwrap()
}

fn fault(kind: FaultKind, target: &str) -> Fault {
    Fault {
        kind,
        target: target.into(),
    }
}

/// What must agree between the searches: the op, why it diverges, its isolated metric, the verdict.
fn verdict(r: &BisectResult) -> Option<String> {
    let d = r.divergence.as_ref()?;
    Some(format!(
        "{} | {:?} | {:?} | {}",
        d.op,
        d.reason,
        d.before.rel_l2,
        match &d.verdict {
            Some(v) => format!(
                "{} {:?} {} {:?} {:?}→{:?}",
                v.kind, v.param.family, v.unit, v.param.bases, v.param.current, v.param.corrected
            ),
            None => "no hypothesis".into(),
        }
    ))
}

/// Faults at layers 1, 2 and 3: some break the layer output clearly (the layer search must name
/// the layer itself, without falling back); the inverted activation scale does not on this model
/// (propagated rel-L2 ≈ 0.5 at its layer, inside the clean noise) and may only break the output
/// layers later or never, where the layer search names its layer or falls back. Either way the
/// verdict is the linear search's.
#[test]
fn bisect_layer_search_names_the_linear_verdict() {
    use FaultKind::*;
    let c = ckpt(Format::CtNvfp4, 3);
    // (fault, the layer it breaks clearly)
    let cases: Vec<(Fault, Option<usize>)> = vec![
        (fault(MissingAlpha, "L1.ffn.experts"), Some(1)),
        (fault(ZeroInputScale, "L2.attn.wo_b"), Some(2)),
        (fault(InvertedWeightScale, "L3.ffn.experts"), Some(3)),
        (fault(InvertedInputScale, "L1.ffn.experts"), None),
        (fault(InvertedInputScale, "L2.attn.q_a"), None),
        (fault(InvertedInputScale, "L3.ffn.experts"), None),
        (fault(InvertedInputScale, "L3.attn.q_a"), None),
    ];
    let bad: Vec<String> = cases
        .par_iter()
        .filter_map(|(f, clear)| {
            let o = opts(4, vec![f.clone()], 7);
            let lin = bisect::bisect_with(&c, &o, Search::Linear).unwrap();
            let lay = bisect::bisect_with(&c, &o, Search::Layers).unwrap();
            let name = format!("{}@{}", f.kind.name(), f.target);
            let mut why = Vec::new();
            if verdict(&lin).is_none() {
                why.push("linear found nothing".to_string());
            }
            if verdict(&lin) != verdict(&lay) {
                why.push(format!(
                    "linear {:?} vs layers {:?}",
                    verdict(&lin),
                    verdict(&lay)
                ));
            }
            if lin.search.ran != Search::Linear || lin.search.requested != Search::Linear {
                why.push("linear did not run linear".into());
            }
            match clear {
                Some(l) => {
                    if lay.search.ran != Search::Layers || lay.search.layer != Some(*l) {
                        why.push(format!(
                            "layer search ran {:?} at {:?} (fell back: {:?})",
                            lay.search.ran, lay.search.layer, lay.search.fell_back
                        ));
                    }
                    if lay.search.total_execs() >= lin.search.total_execs() {
                        why.push(format!(
                            "layer search {} execs ≥ linear {}",
                            lay.search.total_execs(),
                            lin.search.total_execs()
                        ));
                    }
                    // where it shows: the same layer output as the full run's propagated picture
                    let so = |r: &BisectResult| {
                        r.divergence
                            .as_ref()
                            .and_then(|d| d.shows_at_layer_out.clone())
                    };
                    if so(&lin) != so(&lay) {
                        why.push(format!("shows at {:?} vs {:?}", so(&lin), so(&lay)));
                    }
                }
                None => {
                    // the search may still name the layer from a late break; never another one
                    let planted: usize = f.target[1..2].parse().unwrap();
                    if lay.search.ran == Search::Layers && lay.search.layer != Some(planted) {
                        why.push(format!(
                            "layer search named L{:?}, planted L{planted}",
                            lay.search.layer
                        ));
                    }
                }
            }
            println!(
                "{name}: linear {} execs, layers {} execs ({:?}{})",
                lin.search.total_execs(),
                lay.search.total_execs(),
                lay.search.ran,
                lay.search
                    .fell_back
                    .as_ref()
                    .map(|_| ", fell back")
                    .unwrap_or("")
            );
            (!why.is_empty()).then(|| format!("{name}: {}", why.join("; ")))
        })
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// Clean checkpoints: no layer output is clearly broken, so the layer search names no layer, and
/// the fallback finds nothing either.
#[test]
fn bisect_layer_search_finds_nothing_on_clean() {
    let runs = [
        (Format::CtNvfp4, 1u64, 0u64),
        (Format::ModelOptNvfp4, 2, 11),
    ];
    let bad: Vec<String> = runs
        .par_iter()
        .filter_map(|&(f, seed, tseed)| {
            let c = ckpt(f, seed);
            let r = bisect::bisect_with(&c, &opts(4, vec![], tseed), Search::Layers).unwrap();
            let scan = r.search.steps.first();
            let ok = !r.has_findings()
                && r.search.layer.is_none()
                && r.search.fell_back.is_some()
                && scan
                    .is_some_and(|s| s.kind == "scan" && s.layers == (0, 4) && s.broken.is_none());
            (!ok).then(|| format!("{f:?} seed {seed}: {:?} {:?}", verdict(&r), r.search))
        })
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// The one-layer measurement resumed from the scan's states equals a full run's records of that
/// layer: same ops, same isolated error, tolerance and verdicts, same served propagated error
/// (the scan's served path started at layer 0 like the run's).
#[test]
fn bisect_measured_layer_equals_the_run() {
    let c = ckpt(Format::ModelOptNvfp4, 3);
    let o = opts(
        2,
        vec![fault(FaultKind::InvertedInputScale, "L2.ffn.experts")],
        5,
    );
    let rule = ShowRule::from_thresholds(&o.spec.thresholds);
    let sc = scan::scan(&c, &o, &rule, false).unwrap();
    assert_eq!(sc.outs.len(), 3);
    let m = scan::measure_layer(&c, &o, 2, &sc.boundaries[&2]).unwrap();
    let full = run(&c, &o).unwrap();
    let want: Vec<_> = full.records.iter().filter(|r| r.layer == Some(2)).collect();
    assert_eq!(m.records.len(), want.len());
    assert!(want.iter().any(|r| r.divergent), "the fault must diverge");
    for (a, b) in m.records.iter().zip(want) {
        assert_eq!(a.id, b.id);
        assert_eq!(a.step, b.step);
        assert_eq!(a.divergent, b.divergent, "{}", a.id);
        assert_eq!(a.reason, b.reason, "{}", a.id);
        assert_eq!(a.tolerance, b.tolerance, "{}", a.id);
        assert_eq!(
            a.served_isolated_vs_bf16, b.served_isolated_vs_bf16,
            "{}",
            a.id
        );
        assert_eq!(
            a.served_propagated_vs_bf16, b.served_propagated_vs_bf16,
            "{}",
            a.id
        );
        assert_eq!(a.stats["oracle_bf16"], b.stats["oracle_bf16"], "{}", a.id);
        assert_eq!(a.health, b.health, "{}", a.id);
    }
    // the scan's layer outputs are the run's propagated compare at each `Ln.out`
    for lo in &sc.outs {
        let r = full.records.iter().find(|r| r.id == lo.id).unwrap();
        assert_eq!(lo.vs_bf16, r.served_propagated_vs_bf16, "{}", lo.id);
        assert_eq!(lo.shows, r.shows, "{}", lo.id);
    }
    // the captures handed to the replay are the divergent ops' oracle views, first one first
    let cap = m.captures.into_iter().next().unwrap();
    let first = want_first(&full.records);
    assert_eq!(cap.op.id, first);
    // 5 layers of execs: one measured layer costs ≤ 5 per op
    let n = m.records.len();
    assert!(m.execs <= 5 * n && m.execs >= 3 * n);
}

fn want_first(records: &[nvfp4_probe::probe::OpRecord]) -> String {
    records.iter().find(|r| r.divergent).unwrap().id.clone()
}

/// `--search` on the command line: the JSON says which search was asked for, which ran and why;
/// an unknown mode is a usage error.
#[test]
fn bisect_search_flag_cli() {
    use assert_cmd::Command;
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("b.json");
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args([
            "bisect",
            "--layers",
            "0..2",
            "--seq-len",
            "16",
            "--search",
            "layers",
            "--json",
        ])
        .arg(&json)
        .assert()
        .code(0);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let s = &v["search"];
    assert_eq!(s["requested"], "layers");
    // the built-in model is clean: nothing breaks, the linear search confirms it
    assert_eq!(s["ran"], "linear");
    assert!(s["fell_back"].is_string());
    assert_eq!(s["steps"][0]["kind"], "scan");
    let total: u64 = s["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["execs"].as_u64().unwrap())
        .sum();
    assert_eq!(v["op_executions"].as_u64(), Some(total));
    assert!(total > 0);
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["bisect", "--search", "sideways"])
        .assert()
        .code(2);
}

/// Sixteen layers of the random tiny model: clean noise alone reaches rel-L2 0.9 by layer 9, so a
/// scan that never restarted would stop on noise before a fault at layer 12 and point at a clean
/// layer. With the served path restarted every `segment_layers`, the search names layer 12 and
/// the linear verdict, at well under half the linear search's op executions.
#[test]
fn bisect_layer_search_deep_model_noise() {
    let mut so = SynthOptions::new(Preset::Tiny, Format::CtNvfp4, Naming::Official, 3);
    so.layers = Some(16);
    let c = synth::synth_to_memory(&so).unwrap();
    let o = opts(
        15,
        vec![fault(FaultKind::InvertedWeightScale, "L12.ffn.experts")],
        7,
    );
    let rule = ShowRule::from_thresholds(&o.spec.thresholds);
    assert!(rule.segment_layers >= 2 && rule.segment_layers < 9);
    let (lin, lay) = rayon::join(
        || bisect::bisect_with(&c, &o, Search::Linear).unwrap(),
        || bisect::bisect_with(&c, &o, Search::Layers).unwrap(),
    );
    assert!(verdict(&lin).is_some());
    assert_eq!(verdict(&lin), verdict(&lay));
    assert_eq!(lay.search.ran, Search::Layers, "{:?}", lay.search.fell_back);
    assert_eq!(lay.search.layer, Some(12));
    assert!(
        2 * lay.search.total_execs() < lin.search.total_execs(),
        "{} vs {}",
        lay.search.total_execs(),
        lin.search.total_execs()
    );
}

/// The linear search keeps the first divergent op's oracle view from its own run: the tensors are
/// bit for bit what a separate capture pass (the oracle re-run up to the op) computes, and the
/// bisect reports no capture phase.
#[test]
fn bisect_run_capture_equals_the_capture_pass() {
    use nvfp4_probe::probe::{replay, run_capturing};
    for (format, f) in [
        (
            Format::CtNvfp4,
            fault(FaultKind::InvertedInputScale, "L2.attn.q_a"),
        ),
        (
            Format::ModelOptNvfp4,
            fault(FaultKind::MissingAlpha, "L1.ffn.experts"),
        ),
    ] {
        let c = ckpt(format, 4);
        let o = opts(3, vec![f.clone()], 7);
        let (res, caps) = run_capturing(&c, &o, true).unwrap();
        let first = want_first(&res.records);
        // one capture per divergent op, in run order
        let divergent: Vec<&str> = res
            .records
            .iter()
            .filter(|r| r.divergent)
            .map(|r| r.id.as_str())
            .collect();
        let ids: Vec<&str> = caps.iter().map(|c| c.op.id.as_str()).collect();
        assert_eq!(ids, divergent, "{f:?}");
        let cap = caps.into_iter().next().expect("a divergent op is captured");
        assert_eq!(cap.op.id, first, "{f:?}");
        let again = replay::capture(&c, &o, &first).unwrap();
        assert_eq!(cap.inputs.len(), again.inputs.len());
        for (a, b) in cap
            .inputs
            .iter()
            .chain(&cap.oracle_bf16)
            .zip(again.inputs.iter().chain(&again.oracle_bf16))
        {
            assert_eq!(a.shape, b.shape, "{first}");
            let same = a
                .data
                .iter()
                .zip(&b.data)
                .all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{first}: captured tensors differ");
        }
        let r = bisect::bisect(&c, &o).unwrap();
        assert!(r.search.phases.iter().all(|p| p.name != "capture"));
        assert_eq!(r.divergence.as_ref().map(|d| d.op.clone()), Some(first));
    }
    // a clean run captures nothing
    let c = ckpt(Format::CtNvfp4, 4);
    let (res, cap) = run_capturing(&c, &opts(3, vec![], 7), true).unwrap();
    assert!(res.summary.first_divergent.is_none() && cap.is_empty());
}

/// The early reader queues every weight of the run's layers in op order except the routed experts
/// (needed only once routed) and the embedding, within its budget; an in-memory checkpoint queues
/// nothing.
#[test]
fn early_read_skips_routed_experts() {
    use nvfp4_probe::backend::readahead::start_early_read;
    use nvfp4_probe::checkpoint::Span;
    let dir = tempfile::tempdir().unwrap();
    let so = SynthOptions::new(Preset::Tiny, Format::ModelOptNvfp4, Naming::Official, 3);
    synth::synth_to_dir(&so, dir.path()).unwrap();
    let c = Checkpoint::open(dir.path()).unwrap();
    // what it should read for layers 0..=1: stored bytes of every tensor of layers 0 and 1 that
    // is not a routed expert's, plus the non-layer parameters the ops use (norms, hc)
    let layer_bytes: usize = c
        .canonical_names()
        .iter()
        .filter(|n| n.starts_with("layers.0.") || n.starts_with("layers.1."))
        .filter(|n| !n.contains(".ffn.experts."))
        .filter_map(|n| match c.canonical_span(n) {
            Ok(Span::File { len, .. }) => Some(len),
            _ => None,
        })
        .sum();
    let got = start_early_read(&c, 1, usize::MAX);
    assert!(got > 0);
    // never an expert byte: at most the layers' other tensors plus the small global ones
    let global: usize = c
        .canonical_names()
        .iter()
        .filter(|n| !n.starts_with("layers.") && !n.starts_with("embed"))
        .filter_map(|n| c.canonical_span(n).ok().map(|s| s.len()))
        .sum();
    assert!(
        got <= layer_bytes + global,
        "{got} > {layer_bytes} + {global}"
    );
    assert!(got * 10 >= layer_bytes * 9, "{got} ≪ {layer_bytes}");
    // the budget holds
    assert!(start_early_read(&c, 1, got / 2) <= got / 2);
    let mem = ckpt(Format::ModelOptNvfp4, 3);
    assert_eq!(start_early_read(&mem, 1, usize::MAX), 0);
}
