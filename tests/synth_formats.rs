//! Every synthetic format × naming written to disk and read back through `Checkpoint::open`:
//! the config parses, every weight has the scheme the format table (docs/DSV4-LAYER.md §2) says and
//! dequantises to the generated f32 weight within that scheme's quantisation error, every
//! non-linear tensor round-trips with its official dtype.

use nvfp4_probe::checkpoint::{Checkpoint, Dtype, Naming};
use nvfp4_probe::synth::{self, Format, Preset, SynthOptions};

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        num += (*x as f64 - *y as f64).powi(2);
        den += (*y as f64).powi(2);
    }
    (num / den.max(1e-30)).sqrt()
}

/// Expected scheme label per format, transcribed from the task's format list.
fn expected_scheme(format: Format, base: &str) -> &'static str {
    let expert = base.contains(".ffn.experts.");
    let shared = base.contains(".ffn.shared_experts.");
    let leaf = base.rsplit('.').next().unwrap();
    let attn_nv = base.contains(".attn.")
        && !base.contains("compressor")
        && !base.contains("indexer")
        && ["wq_a", "wkv", "wq_b", "wo_b"].contains(&leaf);
    let attn_fp8 = base.contains(".attn.")
        && !base.contains("compressor")
        && (["wq_a", "wkv", "wq_b", "wo_a", "wo_b"].contains(&leaf)
            && (!base.contains("indexer") || leaf == "wq_b"));
    match format {
        Format::Bf16 => "bf16",
        Format::CtNvfp4 if expert || shared || attn_nv => "nvfp4-ct",
        Format::ModelOptNvfp4 if expert || shared || attn_nv => "nvfp4-modelopt",
        Format::OfficialMixed if expert => "nvfp4-modelopt",
        Format::Mxfp4 if expert => "mxfp4",
        Format::OfficialMixed | Format::Mxfp4 if shared || attn_fp8 => "fp8-block",
        _ => "bf16",
    }
}

/// Relative L2 bound of each scheme on N(0, 1/sqrt(in)) weights with outlier columns.
fn tolerance(scheme: &str) -> f64 {
    match scheme {
        "bf16" => 0.0,
        "fp8-block" => 0.05,
        "nvfp4-ct" | "nvfp4-modelopt" => 0.15,
        "mxfp4" => 0.2,
        other => panic!("{other}"),
    }
}

/// Linear count of the tiny model from its config: per layer q_a, kv, q_b, wo_a, wo_b, router,
/// 3 shared, 3 per expert, 2 compressor linears when compressed, 4 indexer linears when r = 4;
/// plus the head.
fn expected_linears(ratios: &[usize], experts: usize) -> usize {
    1 + ratios
        .iter()
        .map(|&r| 9 + 3 * experts + if r > 0 { 2 } else { 0 } + if r == 4 { 4 } else { 0 })
        .sum::<usize>()
}

fn check(format: Format, naming: Naming) {
    let opts = SynthOptions::new(Preset::Tiny, format, naming, 11);
    let dir = tempfile::tempdir().unwrap();
    synth::synth_to_dir(&opts, dir.path()).unwrap();
    let ck = Checkpoint::open(dir.path()).unwrap();
    let tag = format!("{} / {:?}", format.name(), naming);
    let want_naming = match naming {
        Naming::Official => Naming::Official,
        _ => Naming::Hf,
    };
    assert_eq!(ck.naming(), want_naming, "{tag}");
    let cfg = ck.model_config().unwrap().clone();
    assert_eq!(cfg.hidden_size, 256);
    assert_eq!(cfg.num_hidden_layers, 5);
    // HCA 16, not the readers' default 128: the HF naming must carry it in compress_rates
    assert_eq!(cfg.compress_ratios, vec![0, 16, 4, 16, 4], "{tag}");
    assert_eq!(cfg.num_hash_layers, 1, "{tag}");
    assert_eq!(cfg.n_routed_experts, 8);
    assert_eq!(cfg.num_experts_per_tok, 2);
    assert_eq!(cfg.index_n_heads, 16);
    assert_eq!(cfg.index_topk, 8);
    assert_eq!(cfg.o_groups, 2);
    assert_eq!(cfg.routed_scaling_factor, 2.5);
    let y = cfg.yarn.as_ref().expect("yarn on compressed layers");
    assert_eq!(
        (
            y.factor,
            y.original_max_position_embeddings,
            y.beta_fast,
            y.beta_slow
        ),
        (16.0, 65536.0, 32.0, 1.0)
    );

    let bases = ck.weight_bases();
    assert_eq!(
        bases.len(),
        expected_linears(&cfg.compress_ratios, 8),
        "{tag}"
    );
    for base in &bases {
        let w = ck.weight(base).unwrap();
        let scheme = w.scheme();
        assert_eq!(scheme, expected_scheme(format, base), "{tag}: {base}");
        let got = w.dequantize().unwrap();
        let want = synth::generated(&opts, base).unwrap();
        assert_eq!(got.shape, want.shape, "{tag}: {base}");
        let err = rel_l2(&got.data, &want.data);
        assert!(
            err <= tolerance(scheme),
            "{tag}: {base} ({scheme}) rel L2 {err}"
        );
        if scheme != "bf16" {
            assert!(err > 0.0, "{tag}: {base} quantised exactly?");
        }
        let meta = ck.weight_meta(base).unwrap();
        if scheme.starts_with("nvfp4") {
            let x = meta.input_global.expect("static activation scale present");
            assert!(x.is_finite() && x > 0.0, "{tag}: {base} input scale {x}");
        }
        if scheme == "fp8-block" {
            assert_eq!(meta.block, Some([128, 128]));
        }
    }

    // Non-linear tensors: exact values, official dtypes.
    let names = [
        ("embed.weight", Dtype::BF16),
        ("norm.weight", Dtype::BF16),
        ("hc_head_fn", Dtype::F32),
        ("hc_head_scale", Dtype::F32),
        ("layers.0.ffn.gate.tid2eid", Dtype::I64),
        ("layers.1.ffn.gate.bias", Dtype::F32),
        ("layers.1.hc_attn_fn", Dtype::F32),
        ("layers.1.hc_ffn_base", Dtype::F32),
        ("layers.2.attn.attn_sink", Dtype::F32),
        ("layers.2.attn.compressor.ape", Dtype::F32),
        ("layers.2.attn.indexer.compressor.ape", Dtype::F32),
        ("layers.2.attn.indexer.compressor.norm.weight", Dtype::BF16),
        ("layers.3.attn.kv_norm.weight", Dtype::BF16),
        ("layers.4.ffn_norm.weight", Dtype::BF16),
    ];
    for (n, dt) in names {
        let info = ck
            .canonical_info(n)
            .unwrap_or_else(|| panic!("{tag}: {n} missing"));
        assert_eq!(info.dtype, dt, "{tag}: {n}");
        let got = ck.tensor_f32(n).unwrap();
        let want = synth::generated(&opts, n).unwrap();
        assert_eq!(got, want, "{tag}: {n}");
    }
    let sink = ck.tensor_f32("layers.2.attn.attn_sink").unwrap();
    assert!(sink.data.iter().any(|&x| x != 0.0));
    // tid2eid: distinct experts per token.
    let t = ck.tensor_f32("layers.0.ffn.gate.tid2eid").unwrap();
    assert_eq!(t.shape, vec![512, 2]);
    for row in t.data.chunks(2) {
        assert_ne!(row[0], row[1]);
        assert!(row
            .iter()
            .all(|&e| (0.0..8.0).contains(&e) && e.fract() == 0.0));
    }
    // Layer 1 has no tid2eid, layer 0 no bias.
    assert!(ck.canonical_info("layers.1.ffn.gate.tid2eid").is_none());
    assert!(ck.canonical_info("layers.0.ffn.gate.bias").is_none());
    // The config names a quantization method matching the format.
    let qm = ck
        .quantization_config()
        .and_then(|q| q.get("quant_method"))
        .and_then(|m| m.as_str())
        .map(str::to_string);
    let want_qm = match format {
        Format::Bf16 => None,
        Format::CtNvfp4 => Some("compressed-tensors"),
        Format::ModelOptNvfp4 => Some("modelopt"),
        Format::OfficialMixed | Format::Mxfp4 | Format::Fp8Block => Some("fp8"),
    };
    assert_eq!(qm.as_deref(), want_qm, "{tag}");
    if format == Format::OfficialMixed {
        let q = ck.quantization_config().unwrap();
        assert_eq!(q["quant_algo"], "MIXED_PRECISION");
        assert_eq!(q["moe_quant_algo"], "NVFP4");
        assert_eq!(q["scale_fmt"], "ue8m0");
        assert!(ck.hf_quant_config().is_some());
    }
}

#[test]
fn bf16_official() {
    check(Format::Bf16, Naming::Official);
}
#[test]
fn bf16_hf_fused_experts() {
    check(Format::Bf16, Naming::Hf);
}
#[test]
fn ct_nvfp4_official() {
    check(Format::CtNvfp4, Naming::Official);
}
#[test]
fn ct_nvfp4_hf() {
    check(Format::CtNvfp4, Naming::Hf);
}
#[test]
fn modelopt_nvfp4_official() {
    check(Format::ModelOptNvfp4, Naming::Official);
}
#[test]
fn modelopt_nvfp4_hf() {
    check(Format::ModelOptNvfp4, Naming::Hf);
}
#[test]
fn official_mixed_official() {
    check(Format::OfficialMixed, Naming::Official);
}
#[test]
fn official_mixed_hf() {
    check(Format::OfficialMixed, Naming::Hf);
}
#[test]
fn mxfp4_official() {
    check(Format::Mxfp4, Naming::Official);
}
#[test]
fn mxfp4_hf() {
    check(Format::Mxfp4, Naming::Hf);
}

/// CT and ModelOpt store reciprocal conventions of the same calibrated amax (docs/NVFP4.md §3.4):
/// g_ct · d_mo ≈ 1 for every quantised weight; fused partners (w1/w3, q_a/kv) share their tensor
/// scales; w1 and w3 see the same input, w2 another one.
#[test]
fn ct_and_modelopt_scales_are_reciprocal_and_linked() {
    let ct = synth::synth_to_memory(&SynthOptions::new(
        Preset::Tiny,
        Format::CtNvfp4,
        Naming::Official,
        3,
    ))
    .unwrap();
    let mo = synth::synth_to_memory(&SynthOptions::new(
        Preset::Tiny,
        Format::ModelOptNvfp4,
        Naming::Official,
        3,
    ))
    .unwrap();
    let mut n = 0;
    for base in ct.weight_bases() {
        let a = ct.weight_meta(&base).unwrap();
        if a.convention.is_none() {
            continue;
        }
        let b = mo.weight_meta(&base).unwrap();
        for (g, d) in [
            (a.weight_global.unwrap(), b.weight_global.unwrap()),
            (a.input_global.unwrap(), b.input_global.unwrap()),
        ] {
            let p = g as f64 * d as f64;
            assert!((p - 1.0).abs() < 1e-6, "{base}: {g} · {d} = {p}");
        }
        n += 1;
    }
    assert_eq!(n, 4 * 5 + 3 * 5 + 24 * 5);
    let m = |c: &Checkpoint, b: &str| c.weight_meta(b).unwrap();
    for l in 0..5 {
        let qa = m(&ct, &format!("layers.{l}.attn.wq_a"));
        let kv = m(&ct, &format!("layers.{l}.attn.wkv"));
        assert_eq!(qa.weight_global, kv.weight_global);
        assert_eq!(qa.input_global, kv.input_global);
        for e in 0..8 {
            let w1 = m(&mo, &format!("layers.{l}.ffn.experts.{e}.w1"));
            let w3 = m(&mo, &format!("layers.{l}.ffn.experts.{e}.w3"));
            let w2 = m(&mo, &format!("layers.{l}.ffn.experts.{e}.w2"));
            assert_eq!(w1.weight_global, w3.weight_global);
            assert_eq!(w1.input_global, w3.input_global);
            assert_ne!(w1.input_global, w2.input_global);
        }
    }
}

#[test]
fn builtin_model_is_official_mixed_in_memory() {
    let t0 = std::time::Instant::now();
    let ck = synth::builtin(0).unwrap();
    eprintln!("builtin(0) in {:.3} s", t0.elapsed().as_secs_f64());
    assert_eq!(ck.naming(), Naming::Official);
    assert_eq!(
        ck.location(),
        std::path::Path::new(nvfp4_probe::checkpoint::BUILTIN)
    );
    let cfg = ck.model_config().unwrap();
    assert_eq!(cfg.num_hidden_layers, 5);
    assert_eq!(
        ck.weight("layers.1.ffn.experts.0.w1").unwrap().scheme(),
        "nvfp4-modelopt"
    );
    assert_eq!(
        ck.weight("layers.1.attn.wq_b").unwrap().scheme(),
        "fp8-block"
    );
    assert_eq!(
        ck.weight("layers.1.attn.wo_a").unwrap().scheme(),
        "fp8-block"
    );
    assert_eq!(
        ck.weight("layers.2.attn.indexer.wq_b").unwrap().scheme(),
        "fp8-block"
    );
    assert_eq!(ck.weight("layers.2.ffn.gate").unwrap().scheme(), "bf16");
    // Deterministic: same seed, same bytes; another seed, other bytes.
    let again = synth::builtin(0).unwrap();
    let other = synth::builtin(1).unwrap();
    let b = "layers.3.ffn.experts.5.w2.weight";
    assert_eq!(
        ck.canonical_bytes(b).unwrap(),
        again.canonical_bytes(b).unwrap()
    );
    assert_ne!(
        ck.canonical_bytes(b).unwrap(),
        other.canonical_bytes(b).unwrap()
    );
}
