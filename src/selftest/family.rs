//! Self-test of the model families' ops on the device (`device::family` against
//! `kernels/layer.cu`'s `gqa_attn`, `mla_kv`, `copy_cols`, `glu_oss` and `rope_rows`' half-split
//! pairs), bit for bit on fresh random data (never zeros), and whole runs of each family's tiny
//! model on both backends ([`runs`]): Qwen3-MoE and DeepSeek-V3 from `synth --family`, gpt-oss
//! built here in its transformers layout (BF16, fused experts stored [E, in, out]).

use super::layer::{dv, normals, rounded, tag};
use super::{compare_runs, exact, Check, RunAgreement};
use crate::backend::cuda::Gpu;
use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::device::family::{self, GqaDims, MlaDims};
use crate::device::ops::RopeTable;
use crate::model::family::Kind;
use crate::model::mem_env::Rng;
use crate::model::rope::rope_freqs;
use crate::served::faults::Fault;
use crate::tensor::Data;
use crate::Result;

/// One grouped-query attention case of the kernel check.
struct GqaCase {
    what: &'static str,
    dims: GqaDims,
    sinks: bool,
}

fn gqa_case(
    what: &'static str,
    (t, h, kvh, dq, dv): (usize, usize, usize, usize, usize),
    sinks: bool,
    window: Option<usize>,
) -> GqaCase {
    GqaCase {
        what,
        dims: GqaDims {
            t,
            q0: 0,
            h,
            kvh,
            dq,
            dv,
            scale: (dq as f64).powf(-0.5) as f32,
            window,
        },
        sinks,
    }
}

/// `c` as a later token chunk's: its queries after `q0` keys kept from earlier chunks.
fn later(mut c: GqaCase, q0: usize) -> GqaCase {
    c.dims.q0 = q0;
    c
}

/// The family ops' kernel checks, each with and without the BF16 store.
pub fn checks(g: &mut Gpu, rng: &mut Rng, s: usize, out: &mut Vec<Check>) -> Result<()> {
    // ---- grouped-query attention: groups > 1, sinks, windows, prompts of more keys than one
    // tile of scores (1024), value widths beyond the block's 128 threads; t off every block size
    let short = 37 * s + 2;
    let cases = [
        gqa_case(
            "causal, 8 heads on 2 kv",
            (short, 8, 2, 64, 48),
            false,
            None,
        ),
        gqa_case("sinks, window 5", (short, 8, 2, 64, 48), true, Some(5)),
        gqa_case("sinks, window 1", (short, 6, 3, 40, 40), true, Some(1)),
        gqa_case(
            "1300 keys (2 tiles), sinks, dv 160",
            (1300, 4, 1, 32, 160),
            true,
            None,
        ),
        gqa_case(
            "window 1100 (2 tiles), 1 head per kv",
            (1300, 2, 2, 48, 32),
            false,
            Some(1100),
        ),
        // a later token chunk: its queries over the keys kept from earlier chunks and its own
        later(
            gqa_case(
                "later chunk: 300 queries after 1000 keys",
                (300, 4, 2, 32, 48),
                true,
                None,
            ),
            1000,
        ),
        later(
            gqa_case(
                "later chunk: window 5 after 4 kept keys",
                (short, 8, 2, 64, 48),
                true,
                Some(5),
            ),
            4,
        ),
    ];
    for c in &cases {
        let a = c.dims;
        let tk = a.q0 + a.t;
        let q = normals(rng, a.t * a.h * a.dq, 1.0);
        let k = normals(rng, tk * a.kvh * a.dq, 1.0);
        let v = normals(rng, tk * a.kvh * a.dv, 1.0);
        let sinks = c.sinks.then(|| normals(rng, a.h, 1.0));
        let want = family::gqa_core(&q, &k, &v, sinks.as_deref(), a);
        for round in [false, true] {
            let got = g
                .gqa(&dv(&q), &dv(&k), &dv(&v), sinks.as_deref(), a, round)?
                .map(Data::into_vec);
            let name = format!(
                "family gqa: {} (t {}, q0 {}, h {}/{}, dq {}, dv {})",
                c.what, a.t, a.q0, a.h, a.kvh, a.dq, a.dv
            );
            out.push(declined(
                exact(
                    &tag(&name, round),
                    got.as_deref().unwrap_or(&[]),
                    &rounded(want.clone(), round),
                ),
                got.is_none(),
            ));
        }
    }

    // ---- MLA: keys and values gathered on the device and read there by the attention ----
    for round in [false, true] {
        let d = MlaDims {
            t: 23 * s + 4,
            h: 4,
            nope: 32,
            rope: 16,
            dv: 32,
            lora: 48,
        };
        let kvb = normals(rng, d.t * d.h * (d.nope + d.dv), 1.0);
        let kva = normals(rng, d.t * (d.lora + d.rope), 1.0);
        let q = normals(rng, d.t * d.h * (d.nope + d.rope), 1.0);
        let (wk, wv) = family::mla_keys(&kvb, &kva, d);
        let a = GqaDims {
            t: d.t,
            q0: 0,
            h: d.h,
            kvh: d.h,
            dq: d.nope + d.rope,
            dv: d.dv,
            scale: 0.15,
            window: None,
        };
        let want = rounded(family::gqa_core(&q, &wk, &wv, None, a), round);
        let (k, v) = g.mla_keys(&dv(&kvb), &dv(&kva), d)?;
        let got = g.gqa(&dv(&q), &k, &v, None, a, round)?;
        let on_device = !k.on_host() && !v.on_host();
        let mut c = exact(
            &tag("family mla attention on gathered keys", round),
            got.as_deref().map_or(&[][..], |x| &x[..]),
            &want,
        );
        if !on_device {
            c.mismatches += 1;
            c.note = "the gathered keys were fetched to the host before the attention".into();
        }
        out.push(declined(c, got.is_none()));
        if !round {
            out.push(exact("family mla key gather", &k, &wk));
            out.push(exact("family mla value gather", &v, &wv));
        }
    }

    // ---- half-split RoPE (every head's rotary tail; DeepSeek-V3's shared key: one wide head) ----
    for (what, t, nh, dh, nope) in [
        ("4 heads of 64, 48 rotary", 19 * s, 4, 64, 16),
        ("one head of 112, last 16 rotary", 13 * s + 1, 1, 112, 96),
    ] {
        let tab = RopeTable::new(&rope_freqs(dh - nope, 150000.0, None), 0..t);
        let x = normals(rng, t * nh * dh, 2.0);
        let mut want = x.clone();
        for (p, row) in want.chunks_mut(nh * dh).enumerate() {
            for head in row.chunks_mut(dh) {
                tab.apply_split(&mut head[nope..], p);
            }
        }
        for round in [false, true] {
            let got = g.rope_split(&dv(&x), nh, dh, nope, &tab, round)?;
            out.push(exact(
                &tag(&format!("family rope half-split: {what}"), round),
                &got,
                &rounded(want.clone(), round),
            ));
        }
    }

    // ---- column slice (MLA's latent before its norm) ----
    let (rows, cols) = (17 * s + 3, 80);
    let x = normals(rng, rows * cols, 1.0);
    for (c0, w) in [(0usize, 64usize), (13, 20)] {
        let got = g.slice_cols(&dv(&x), cols, c0, w)?;
        out.push(exact(
            &format!("family column slice [{c0}, {}) of {cols}", c0 + w),
            &got,
            &family::slice_cols(&x, cols, c0, w),
        ));
    }

    // ---- gpt-oss's clamped GLU: gates and ups beyond ±7, NaN, ±inf ----
    let (n, i) = (21 * s + 2, 96);
    let mut gu = normals(rng, n * 2 * i, 5.0);
    gu[0] = f32::NAN; // a NaN gate: the limit
    gu[3] = f32::NAN; // a NaN up: NaN
    gu[4] = f32::INFINITY;
    gu[7] = f32::NEG_INFINITY;
    gu[9] = -1.0; // up = −1: zero
    let want = family::glu_rows(&gu, 7.0);
    // the same units as separate gate and up projections (llm-compressor's linear experts)
    let (gs, us): (Vec<f32>, Vec<f32>) = gu.chunks(2).map(|p| (p[0], p[1])).unzip();
    for round in [false, true] {
        let got = g.glu_oss(&dv(&gu), None, n * i, 7.0, round)?;
        out.push(exact(
            &tag("family gpt-oss clamped GLU (limit 7)", round),
            &got,
            &rounded(want.clone(), round),
        ));
        let got = g.glu_oss(&dv(&gs), Some(&dv(&us)), n * i, 7.0, round)?;
        out.push(exact(
            &tag(
                "family gpt-oss clamped GLU, gate and up apart (limit 7)",
                round,
            ),
            &got,
            &rounded(want.clone(), round),
        ));
    }
    Ok(())
}

/// A kernel that declined the case (the host would compute it) fails its check: the cases are
/// sized to run on the device.
fn declined(mut c: Check, none: bool) -> Check {
    if none {
        c.mismatches += 1;
        c.note = "the device declined the case (shared memory)".into();
    }
    c
}

/// One whole-run comparison of a family model: its result line, the details of a failure, the
/// JSON the self-test writes.
pub struct FamilyRun {
    pub pass: bool,
    pub line: String,
    pub details: Vec<String>,
    pub json: serde_json::Value,
}

/// The tiny models of the families: (name, checkpoint, loader faults). The faulted runs hold the
/// device's served reading of gpt-oss's fused experts to the CPU's where a loader re-orders
/// `w13`'s rows or leaves MXFP4 `_scales` unread (values the host prepares, not the stored bytes).
fn models(seed: u64) -> Result<Vec<(&'static str, Checkpoint, Vec<Fault>)>> {
    use crate::synth::{synth_to_memory, Format, SynthOptions};
    let fam = |k: Kind, f: Format| synth_to_memory(&SynthOptions::family(k, f, seed));
    let fault = |s: &str| Fault::parse(s).map(|f| vec![f]);
    Ok(vec![
        (
            "qwen3-moe ct-nvfp4",
            fam(Kind::Qwen3Moe, Format::CtNvfp4)?,
            vec![],
        ),
        (
            "deepseek-v3 fp8-block",
            fam(Kind::DeepseekV3, Format::Fp8Block)?,
            vec![],
        ),
        (
            "deepseek-v3 modelopt-nvfp4",
            fam(Kind::DeepseekV3, Format::ModelOptNvfp4)?,
            vec![],
        ),
        ("gpt-oss bf16", gpt_oss_tiny(seed)?, vec![]),
        (
            "gpt-oss modelopt-nvfp4",
            fam(Kind::GptOss, Format::ModelOptNvfp4)?,
            vec![],
        ),
        (
            "gpt-oss modelopt-nvfp4 + gate-up-interleaved-twice@L1.ffn.experts",
            fam(Kind::GptOss, Format::ModelOptNvfp4)?,
            fault("gate-up-interleaved-twice@L1.ffn.experts")?,
        ),
        (
            "gpt-oss mxfp4 + gate-up-deinterleaved@L1.ffn.experts",
            fam(Kind::GptOss, Format::Mxfp4)?,
            fault("gate-up-deinterleaved@L1.ffn.experts")?,
        ),
        (
            "gpt-oss mxfp4 + missing-block-scales@L1.ffn.experts",
            fam(Kind::GptOss, Format::Mxfp4)?,
            fault("missing-block-scales@L1.ffn.experts")?,
        ),
    ])
}

/// Tokens per chunk of the family runs taken again in token chunks.
const CHUNK: usize = 7;

/// Whole runs of every family's tiny model over all its layers, `seq_len` tokens, under each
/// served profile, on the CPU and on `device` (the self-test's CUDA backend): the same agreement
/// the V4 whole run is held to (NaN/Inf counts equal, amax within 1e-4, |Δcos| ≤ 1e-4, the same
/// divergent ops). The models without loader faults run once more on `device` in token chunks
/// of [`CHUNK`] (the attention's keys and values carried from chunk to chunk), whose every op
/// record must equal the whole prompt's by [`super::differing_ops`]' rule (the V4 chunk check's:
/// f64 sums, whose atomic order varies on the GPU, within 1e-9).
pub fn runs(
    device: Backend,
    profiles: &[String],
    seq_len: usize,
    seed: u64,
) -> Result<Vec<FamilyRun>> {
    let mut out = Vec::new();
    for (name, ckpt, faults) in models(seed)? {
        let cfg = ckpt.model_config()?.clone();
        let tokens = crate::probe::synthetic_tokens(seq_len, cfg.vocab_size, seed);
        for profile in profiles {
            let mut opts = crate::probe::RunOptions {
                profile: crate::served::Profile::parse(profile)?,
                loader_faults: faults.clone(),
                ..crate::probe::RunOptions::new((0, cfg.num_hidden_layers - 1), tokens.clone())
            };
            let cpu = crate::probe::run(&ckpt, &opts)?;
            opts.backend = device.clone();
            let dev = crate::probe::run(&ckpt, &opts)?;
            let a = compare_runs(&cpu, &dev);
            // a divergent op's consequences are not followed in chunks: faulted runs differ there
            let chunked = match faults.is_empty() && seq_len > CHUNK {
                true => {
                    let c = crate::probe::run(
                        &ckpt,
                        &crate::probe::RunOptions {
                            chunk: Some(CHUNK),
                            ..opts.clone()
                        },
                    )?;
                    Some(super::differing_ops(&dev.records, &c.records))
                }
                false => None,
            };
            out.push(family_run(
                name,
                profile,
                &cfg,
                seq_len,
                &a,
                chunked,
                cpu.seconds,
                dev.seconds,
            ));
        }
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn family_run(
    name: &str,
    profile: &str,
    cfg: &crate::model::ModelConfig,
    seq_len: usize,
    a: &RunAgreement,
    chunked: Option<Vec<String>>,
    cpu_s: f64,
    cuda_s: f64,
) -> FamilyRun {
    let pass = a.ops > 0
        && a.stat_mismatches.is_empty()
        && a.worst_cos_delta <= 1e-4
        && a.divergent_cpu == a.divergent_gpu
        && chunked.as_ref().is_none_or(Vec::is_empty);
    let chunk_note = match &chunked {
        Some(d) if d.is_empty() => format!("; in chunks of {CHUNK}: every record equal"),
        Some(d) => format!(
            "; in chunks of {CHUNK}: {} fields differ, first {}",
            d.len(),
            d[0]
        ),
        None => String::new(),
    };
    let line = format!(
        "family run `{name}` `{profile}` layers 0..{} T={seq_len}: {} ops; amax/NaN/Inf mismatches {}; worst |Δcos| {:.2e} at {}; worst amax rel {:.2e}; divergent ops cpu {} / cuda {}{chunk_note}; cpu {:.2} s, cuda {:.2} s — {}",
        cfg.num_hidden_layers - 1,
        a.ops,
        a.stat_mismatches.len(),
        a.worst_cos_delta,
        if a.worst_cos_op.is_empty() { "-" } else { &a.worst_cos_op },
        a.worst_amax_rel,
        a.divergent_cpu,
        a.divergent_gpu,
        cpu_s,
        cuda_s,
        if pass { "PASS" } else { "FAIL" }
    );
    FamilyRun {
        pass,
        line,
        details: a.stat_mismatches.iter().take(10).cloned().collect(),
        json: serde_json::json!({
            "family": name, "profile": profile, "agreement": a,
            "chunked_fields_differing": chunked.as_ref().map(Vec::len),
            "cpu_seconds": cpu_s, "cuda_seconds": cuda_s, "pass": pass,
        }),
    }
}

/// A tiny gpt-oss in transformers' own layout (`GptOssForCausalLM.save_pretrained`): BF16, q/k/v/o
/// with biases, per-head sinks, alternating sliding (window 8) and full layers, YaRN, a biased
/// router, fused experts `gate_up_proj` [E, D, 2I] (gate/up interleaved, stored [in, out]) and
/// `down_proj` [E, I, D] with their biases. Weights of unit-variance outputs, so the 64-token runs
/// neither vanish nor overflow.
pub fn gpt_oss_tiny(seed: u64) -> Result<Checkpoint> {
    let (d, layers, vocab, heads, kvh, hd, e, k, inter) = (128, 2, 256, 4, 2, 32, 8, 2, 64);
    let config = serde_json::json!({
        "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
        "hidden_size": d, "num_hidden_layers": layers, "vocab_size": vocab,
        "num_attention_heads": heads, "num_key_value_heads": kvh, "head_dim": hd,
        "num_local_experts": e, "num_experts_per_tok": k, "intermediate_size": inter,
        "sliding_window": 8, "rms_norm_eps": 1e-5, "attention_bias": true,
        "layer_types": ["sliding_attention", "full_attention"],
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
            "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
            "truncate": false},
        "tie_word_embeddings": false, "swiglu_limit": 7.0
    });
    let mut rng = Rng::new(seed ^ 0x6770_742d_6f73);
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, mean: f64, std: f64| {
        let n = shape.iter().product();
        let bytes = rng
            .normals(n, mean, std)
            .iter()
            .flat_map(|&v| crate::numerics::bf16::to_bits(v).to_le_bytes())
            .collect();
        tensors.push((name, shape, bytes));
    };
    let lin = |fan_in: usize| (fan_in as f64).powf(-0.5);
    add("model.embed_tokens.weight".into(), vec![vocab, d], 0.0, 1.0);
    add("model.norm.weight".into(), vec![d], 1.0, 0.1);
    add("lm_head.weight".into(), vec![vocab, d], 0.0, lin(d));
    for n in 0..layers {
        let p = |s: &str| format!("model.layers.{n}.{s}");
        add(p("input_layernorm.weight"), vec![d], 1.0, 0.1);
        add(p("post_attention_layernorm.weight"), vec![d], 1.0, 0.1);
        for (s, rows) in [("q", heads * hd), ("k", kvh * hd), ("v", kvh * hd)] {
            add(
                p(&format!("self_attn.{s}_proj.weight")),
                vec![rows, d],
                0.0,
                lin(d),
            );
            add(p(&format!("self_attn.{s}_proj.bias")), vec![rows], 0.0, 0.1);
        }
        add(
            p("self_attn.o_proj.weight"),
            vec![d, heads * hd],
            0.0,
            lin(heads * hd),
        );
        add(p("self_attn.o_proj.bias"), vec![d], 0.0, 0.1);
        add(p("self_attn.sinks"), vec![heads], 0.0, 1.0);
        add(p("mlp.router.weight"), vec![e, d], 0.0, lin(d));
        add(p("mlp.router.bias"), vec![e], 0.0, 0.1);
        add(
            p("mlp.experts.gate_up_proj"),
            vec![e, d, 2 * inter],
            0.0,
            2.0 * lin(d),
        );
        add(
            p("mlp.experts.gate_up_proj_bias"),
            vec![e, 2 * inter],
            0.0,
            0.1,
        );
        add(
            p("mlp.experts.down_proj"),
            vec![e, inter, d],
            0.0,
            lin(inter),
        );
        add(p("mlp.experts.down_proj_bias"), vec![e, d], 0.0, 0.1);
    }
    let refs: Vec<(&str, safetensors::Dtype, &[usize], &[u8])> = tensors
        .iter()
        .map(|(n, s, b)| (n.as_str(), safetensors::Dtype::BF16, &s[..], &b[..]))
        .collect();
    let bytes = crate::checkpoint::writer::serialize(&refs, None)?;
    Checkpoint::from_memory(
        &config.to_string(),
        vec![("model.safetensors".into(), bytes)],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The whole-run comparison's plumbing without a device: every family model builds and runs
    /// on both sides (here the CPU twice, which must agree exactly), one line per model and
    /// profile naming it.
    #[test]
    fn every_family_model_runs_and_reports_a_line() {
        let profiles = ["blackwell-w4a4".to_string()];
        let r = runs(Backend::Cpu, &profiles, 12, 1).unwrap();
        assert_eq!(r.len(), 8);
        for (i, (x, name)) in r
            .iter()
            .zip([
                "qwen3-moe",
                "deepseek-v3 fp8",
                "deepseek-v3 modelopt",
                "gpt-oss bf16",
                "gpt-oss modelopt",
                "gpt-oss modelopt-nvfp4 + gate-up-interleaved-twice",
                "gpt-oss mxfp4 + gate-up-deinterleaved",
                "gpt-oss mxfp4 + missing-block-scales",
            ])
            .enumerate()
        {
            assert!(x.pass, "{}", x.line);
            // the loader faults show (what the device is held to is a visible fault); the clean
            // models diverge nowhere
            let divergent = x.json["agreement"]["divergent_cpu"].as_u64().unwrap();
            assert_eq!(divergent > 0, i >= 5, "{}", x.line);
            assert!(
                x.line.contains(name) && x.line.contains("blackwell-w4a4"),
                "{}",
                x.line
            );
            assert!(x.line.contains("worst |Δcos| 0.00e0"), "{}", x.line);
            // the clean models also ran in token chunks, every record as the whole prompt's
            assert_eq!(
                x.line.contains("in chunks of 7: every record equal"),
                i < 5,
                "{}",
                x.line
            );
        }
    }

    /// The built gpt-oss reads as gpt-oss with its experts' slices transposed, and runs on the
    /// CPU over both layer kinds (sliding and full) to finite outputs with its routed experts
    /// used: what the self-test compares the device with is a working model.
    #[test]
    fn the_tiny_gpt_oss_is_a_working_model() {
        let ck = gpt_oss_tiny(3).unwrap();
        let cfg = ck.model_config().unwrap().clone();
        let fam = cfg.family.as_ref().unwrap();
        assert_eq!(fam.kind, Kind::GptOss);
        assert_eq!(fam.sliding, [true, false]);
        assert!(ck.stored_transposed("layers.1.ffn.experts.3.w13.weight"));
        assert_eq!(crate::model::family::cuda_unsupported(&cfg), None);
        // 20 tokens: more than the sliding layer's window of 8
        let tokens = crate::probe::synthetic_tokens(20, cfg.vocab_size, 3);
        let r = crate::probe::run(&ck, &crate::probe::RunOptions::new((0, 1), tokens)).unwrap();
        for id in ["L0.attn.core", "L1.attn.core", "L0.ffn.experts"] {
            assert!(r.records.iter().any(|x| x.id == id), "{id}");
        }
        for rec in &r.records {
            for (path, st) in &rec.stats {
                assert_eq!((st.nan, st.inf), (0, 0), "{} {path}", rec.id);
            }
        }
        let ex = r.records.iter().find(|x| x.id == "L1.ffn.experts").unwrap();
        assert!(ex.stats.values().all(|s| s.amax > 0.0), "{:?}", ex.stats);
    }
}
