//! The built-in model behaves like a trained one under the served paths (issue 19 item 3): a
//! clean default run shows no propagated error above the documented line (`shows`: propagated
//! rel-L2 vs the BF16 oracle > `propagated_rel_l2`, 0.5) under every served profile and several
//! seeds; every compressor produces rows at the default prompt length; the routers keep their
//! choices under the served path's perturbation (margins measured here from the oracle's and
//! the served path's router inputs and the generated gate weights); each block adds a modest
//! fraction of the residual stream; and planted faults still stand out.

use assert_cmd::Command;
use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::model::ModelConfig;
use nvfp4_probe::probe::{self, synthetic_tokens, RunOptions};
use nvfp4_probe::served::Profile;
use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};
use nvfp4_probe::Tensor;
use rayon::prelude::*;
use serde_json::Value;

const PROFILES: [&str; 3] = ["blackwell-w4a4", "hopper-w4a16", "emulation"];
const SEEDS: [u64; 3] = [0, 1, 2];

/// `nvfp4-probe run` on the built-in model with the given extra args; the run JSON and the exit code.
fn run_json(args: &[&str]) -> (Value, i32) {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("run.json");
    let out = Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args(["run", "--quiet", "--backend", "cpu", "--json"])
        .arg(&json)
        .args(args)
        .output()
        .unwrap();
    let code = out.status.code().unwrap_or(-1);
    let text = std::fs::read_to_string(&json).unwrap_or_else(|_| {
        panic!(
            "no run JSON (exit {code}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    (serde_json::from_str(&text).unwrap(), code)
}

fn ops(v: &Value) -> &Vec<Value> {
    v["ops"].as_array().unwrap()
}

fn op<'a>(v: &'a Value, id: &str) -> &'a Value {
    ops(v)
        .iter()
        .find(|o| o["id"] == id)
        .unwrap_or_else(|| panic!("no op {id}"))
}

/// The default run (all layers, default prompt length) under each profile and seed: exit 0, no
/// divergent and no `shows` op, every compressor op with rows of non-zero amax on every path.
#[test]
fn default_run_is_clean_under_every_profile_and_seed() {
    let cases: Vec<(&str, u64)> = PROFILES
        .iter()
        .flat_map(|p| SEEDS.iter().map(move |s| (*p, *s)))
        .collect();
    let bad: Vec<String> = cases
        .par_iter()
        .flat_map(|&(profile, seed)| {
            let seed_s = seed.to_string();
            let (v, code) = run_json(&["--served", profile, "--seed", &seed_s]);
            let mut bad = Vec::new();
            let tag = format!("{profile} seed {seed}");
            if code != 0 {
                bad.push(format!("{tag}: exit {code}"));
            }
            assert_eq!(v["tokens"]["count"], 64, "{tag}: default prompt length");
            let mut compressors = 0;
            let mut worst = (0f64, String::new());
            for o in ops(&v) {
                let id = o["id"].as_str().unwrap();
                if o["shows"] == true || o["divergent"] == true {
                    bad.push(format!("{tag}: {id} shows/diverges"));
                }
                if let Some(r) = o["served_propagated_vs_bf16"]["rel_l2"].as_f64() {
                    if o["agreement"].is_null() && r > worst.0 {
                        worst = (r, id.to_string());
                    }
                }
                if id.ends_with(".compressor") {
                    compressors += 1;
                    for path in ["oracle_fp32", "oracle_bf16", "served"] {
                        let s = &o["stats"][path];
                        if s["numel"].as_u64().unwrap() == 0 || s["amax"].as_f64().unwrap() <= 0.0 {
                            bad.push(format!("{tag}: {id} has no rows on {path}"));
                        }
                    }
                }
            }
            // the tiny model's layers 1..4 all compress (HCA, CSA, HCA, CSA)
            if compressors != 4 {
                bad.push(format!("{tag}: {compressors} compressor ops"));
            }
            if v["summary"]["first_shows"].as_str().is_some() {
                bad.push(format!("{tag}: summary names a first visible error"));
            }
            println!(
                "{tag}: worst propagated rel-L2 {:.3} at {}",
                worst.0, worst.1
            );
            bad
        })
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// The kept outputs of one op on one path.
fn kept<'a>(r: &'a probe::RunResult, path: &str, id: &str) -> &'a Tensor {
    &r.outputs[path]
        .iter()
        .find(|(i, _)| i == id)
        .unwrap_or_else(|| panic!("{path}: no {id}"))
        .1
}

fn sqrt_softplus(x: f32) -> f32 {
    let sp = if x > 20.0 { x } else { x.exp().ln_1p() };
    sp.sqrt()
}

/// The routers' choices hold under the served path. At every biased-top-k router, for every
/// token: the oracle's margin (its weakest chosen expert's selection key minus its strongest
/// other one, keys = sqrt-softplus of the logits plus the bias, recomputed here from the
/// oracle's router input and the generated gate weights) and the same margin on the served
/// path's router input. The served path picks the oracle's experts for every token, and the
/// median margin is ≥ 25× the median change the served path makes to it (a trained router has
/// clear winners for most tokens; the tightest token of a prompt may be far closer, as in a
/// real model, and is printed).
#[test]
fn routing_margins_clear_the_served_perturbation() {
    let cases: Vec<(u64, Profile)> = match std::env::var("ROUTING_SEEDS") {
        // a wider survey: ROUTING_SEEDS=0..20 cargo nextest run --test builtin_model --no-capture
        Ok(r) => {
            let (a, b) = r.split_once("..").unwrap();
            (a.parse().unwrap()..b.parse().unwrap())
                .flat_map(|s| {
                    [
                        Profile::BlackwellW4a4,
                        Profile::HopperW4a16,
                        Profile::Emulation,
                    ]
                    .map(|p| (s, p))
                })
                .collect()
        }
        Err(_) => vec![
            (0, Profile::BlackwellW4a4),
            (1, Profile::HopperW4a16),
            (2, Profile::Emulation),
        ],
    };
    let bad: Vec<String> = cases
        .par_iter()
        .flat_map(|&(seed, profile)| routing_case(seed, profile))
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

fn routing_case(seed: u64, profile: Profile) -> Vec<String> {
    let ck = synth::builtin(seed).unwrap();
    let cfg: ModelConfig = ck.model_config().unwrap().clone();
    let (e, k, d) = (
        cfg.n_routed_experts,
        cfg.num_experts_per_tok,
        cfg.hidden_size,
    );
    let tokens = synthetic_tokens(64, cfg.vocab_size, seed);
    let mut opts = RunOptions::new((0, cfg.num_hidden_layers - 1), tokens);
    opts.profile = profile;
    opts.keep_outputs = true;
    let r = probe::run(&ck, &opts).unwrap();
    let gen = SynthOptions::new(Preset::Tiny, Format::OfficialMixed, Naming::Official, seed);
    let mut bad = Vec::new();
    for layer in cfg.num_hash_layers..cfg.num_hidden_layers {
        let gate = synth::generated(&gen, &format!("layers.{layer}.ffn.gate")).unwrap();
        let bias = synth::generated(&gen, &format!("layers.{layer}.ffn.gate.bias")).unwrap();
        let keys = |x: &Tensor| -> Vec<Vec<f32>> {
            x.data
                .chunks_exact(d)
                .map(|row| {
                    (0..e)
                        .map(|ex| {
                            let l: f64 = row
                                .iter()
                                .zip(&gate.data[ex * d..(ex + 1) * d])
                                .map(|(a, b)| *a as f64 * *b as f64)
                                .sum();
                            sqrt_softplus(l as f32) + bias.data[ex]
                        })
                        .collect()
                })
                .collect()
        };
        let norm = format!("L{layer}.ffn.norm");
        let ko = keys(kept(&r, "oracle_bf16", &norm));
        let ks = keys(kept(&r, "served", &norm));
        // (oracle margin, its change on the served path) per token
        let mut per: Vec<(f32, f32)> = Vec::new();
        for (a, b) in ko.iter().zip(&ks) {
            let mut order: Vec<usize> = (0..e).collect();
            order.sort_by(|&i, &j| a[j].total_cmp(&a[i]));
            let (chosen, rest) = order.split_at(k);
            let margin = |v: &[f32]| {
                chosen.iter().map(|&i| v[i]).fold(f32::INFINITY, f32::min)
                    - rest.iter().map(|&i| v[i]).fold(f32::NEG_INFINITY, f32::max)
            };
            let (mo, ms) = (margin(a), margin(b));
            per.push((mo, (mo - ms).abs()));
        }
        let median = |mut v: Vec<f32>| {
            v.sort_by(f32::total_cmp);
            v[v.len() / 2]
        };
        let m_margin = median(per.iter().map(|p| p.0).collect());
        let m_moved = median(per.iter().map(|p| p.1).collect());
        let tight = per
            .iter()
            .copied()
            .min_by(|x, y| (x.0 / x.1).total_cmp(&(y.0 / y.1)))
            .unwrap();
        let set = |t: &Tensor| -> Vec<Vec<u32>> {
            t.data
                .chunks_exact(k)
                .map(|c| {
                    let mut v: Vec<u32> = c.iter().map(|&x| x as u32).collect();
                    v.sort();
                    v
                })
                .collect()
        };
        let idx = format!("L{layer}.ffn.router.idx");
        let (so, ss) = (
            set(kept(&r, "oracle_bf16", &idx)),
            set(kept(&r, "served", &idx)),
        );
        let flips = so.iter().zip(&ss).filter(|(a, b)| a != b).count();
        let tag = format!("seed {seed} {profile:?} L{layer}");
        println!(
            "{tag}: median margin {m_margin:.3}, median served change {m_moved:.4} ({:.0}×); \
             tightest token {:.3} moved {:.4}; flips {flips}/{}",
            m_margin / m_moved,
            tight.0,
            tight.1,
            so.len()
        );
        if flips > 0 {
            bad.push(format!("{tag}: {flips} tokens changed experts"));
        }
        if m_margin < 25.0 * m_moved {
            bad.push(format!(
                "{tag}: median margin {m_margin:.3} vs median served change {m_moved:.4}"
            ));
        }
    }
    bad
}

/// Each block adds a modest fraction of the residual stream (mean |block output| over mean
/// |stream| at the block's input, FP32 oracle): 0.1–0.45 for every attention and FFN block,
/// where i.i.d. weights gave ~0.35 (attention) and ~1.8 (FFN).
#[test]
fn blocks_add_a_modest_fraction_of_the_stream() {
    let (v, _) = run_json(&[]);
    let mean_abs = |id: &str| {
        op(&v, id)["stats"]["oracle_fp32"]["mean_abs"]
            .as_f64()
            .unwrap()
    };
    let last = v["layers"][1].as_u64().unwrap() as usize;
    assert_eq!(last, 4, "the tiny model's five layers");
    let mut stream = mean_abs("hc_expand");
    for l in 0..=last {
        for (y, after) in [
            (format!("L{l}.attn.wo_b"), format!("L{l}.attn.hc_post")),
            (format!("L{l}.ffn.out"), format!("L{l}.out")),
        ] {
            let ratio = mean_abs(&y) / stream;
            assert!(
                (0.1..0.45).contains(&ratio),
                "{y}: update/stream {ratio:.3}"
            );
            stream = mean_abs(&after);
        }
    }
}

/// Planted faults stand out of the clean run: a loader fault (missing alpha at L3's routed
/// experts) and a checkpoint fault (activation calibration amax 64× too small at L1's routed
/// experts) make their op the first divergent one, and the run exits 1.
#[test]
fn planted_faults_stand_out() {
    let (v, code) = run_json(&["--loader-fault", "missing-alpha@L3.ffn.experts"]);
    assert_eq!(code, 1);
    assert_eq!(v["summary"]["first_divergent"], "L3.ffn.experts");
    let o = op(&v, "L3.ffn.experts");
    assert_eq!(o["divergent"], true);
    assert_eq!(o["shows"], true, "missing alpha is visible downstream too");

    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("m");
    Command::cargo_bin("nvfp4-probe")
        .unwrap()
        .args([
            "synth",
            "--preset",
            "tiny",
            "--format",
            "official-mixed",
            "--fault",
            "input-amax-x64@L1.ffn.experts",
            "--out",
        ])
        .arg(&model)
        .assert()
        .code(0);
    let m = model.to_str().unwrap();
    let (v, code) = run_json(&["--model", m]);
    assert_eq!(code, 1);
    assert_eq!(v["summary"]["first_divergent"], "L1.ffn.experts");
}
