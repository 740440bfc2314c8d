//! The families' checkpoints made by the producers themselves (tests/data/hf-families/*/
//! {ct-nvfp4,modelopt-nvfp4}: compressed-tensors 0.20.0 and ModelOpt 0.47.0 quantizing the tiny
//! transformers-made Qwen3-MoE and DeepSeek-V3, see that folder's README): every weight whose
//! producer dequantization is kept beside the checkpoint (`dequant-layer1.safetensors`, keyed by
//! the BF16 name) resolves to a canonical NVFP4 weight of the producer's convention whose
//! dequantization equals the producer's own, value by value; and `lint` finds no error. The same
//! for gpt-oss in the released MXFP4 layout (`gpt_oss/mxfp4`), against transformers' own
//! `convert_moe_packed_tensors`.

use std::path::{Path, PathBuf};

use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::lint::{lint_dir, Rules, Severity};
use safetensors::SafeTensors;

#[path = "verdict_support/mod.rs"]
mod verdict_support;
use verdict_support::run_report;

fn dir(family: &str, kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(family)
        .join(kind)
}

/// F32 little-endian values of a safetensors tensor.
fn f32s(t: &safetensors::tensor::TensorView) -> Vec<f32> {
    t.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// No finding of error severity from `lint` on the directory.
fn lint_clean(d: &Path, what: &str) {
    let r = lint_dir(d, None, &Rules::default()).unwrap();
    let errors: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.severity >= Severity::Error)
        .map(|f| format!("{} {}", f.rule, f.evidence))
        .collect();
    assert!(errors.is_empty(), "{what}: {errors:?}");
}

fn check(family: &str, kind: &str, scheme: &str, min: usize) {
    let d = dir(family, kind);
    let ck = Checkpoint::open(&d).unwrap();
    let bytes = std::fs::read(d.join("dequant-layer1.safetensors")).unwrap();
    let deq = SafeTensors::deserialize(&bytes).unwrap();
    let mut n = 0;
    for (name, t) in deq.tensors() {
        let module = name.strip_suffix(".weight").unwrap();
        let canon = ck
            .canonical_of(&format!("{module}.weight_scale"))
            .unwrap_or_else(|| panic!("{family}/{kind} {module}: no canonical name"))
            .strip_suffix(".weight_scale")
            .unwrap()
            .to_string();
        let w = ck.weight(&canon).unwrap();
        assert_eq!(w.scheme(), scheme, "{family}/{kind} {module}");
        let got = w.dequantize().unwrap();
        let want = f32s(&t);
        assert_eq!(got.data.len(), want.len(), "{family}/{kind} {module}");
        let bad = got.data.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            bad, 0,
            "{family}/{kind} {module}: {bad} values differ from the producer's dequantization"
        );
        n += 1;
    }
    assert!(n >= min, "{family}/{kind}: {n} weights checked");
    lint_clean(&d, &format!("{family}/{kind}"));
}

#[test]
fn qwen3_moe_compressed_tensors() {
    check("qwen3_moe", "ct-nvfp4", "nvfp4-ct", 10);
}

#[test]
fn qwen3_moe_modelopt() {
    check("qwen3_moe", "modelopt-nvfp4", "nvfp4-modelopt", 10);
}

#[test]
fn deepseek_v3_compressed_tensors() {
    check("deepseek_v3", "ct-nvfp4", "nvfp4-ct", 14);
}

#[test]
fn deepseek_v3_modelopt() {
    check("deepseek_v3", "modelopt-nvfp4", "nvfp4-modelopt", 9);
}

/// gpt-oss's layer-1 experts whose producer dequantization is kept beside the checkpoint (one
/// tensor per fused projection, [E, in, out] when `kept_in_out`, else [E, out, in]): each expert's
/// `w13` (rows gate/up interleaved as stored) and `w2` resolve to a weight of `scheme` whose
/// dequantization equals it value by value. Returns the weights checked.
fn layer1_experts_match(d: &Path, ck: &Checkpoint, scheme: &str, kept_in_out: bool) -> usize {
    let bytes = std::fs::read(d.join("dequant-layer1.safetensors")).unwrap();
    let deq = SafeTensors::deserialize(&bytes).unwrap();
    let mut n = 0;
    for (fused, proj) in [("gate_up_proj", "w13"), ("down_proj", "w2")] {
        let t = deq
            .tensor(&format!("model.layers.1.mlp.experts.{fused}"))
            .unwrap();
        let (experts, a, b) = (t.shape()[0], t.shape()[1], t.shape()[2]);
        let (outf, inf) = if kept_in_out { (b, a) } else { (a, b) };
        let theirs = f32s(&t);
        for e in 0..experts {
            let w = ck
                .weight(&format!("layers.1.ffn.experts.{e}.{proj}"))
                .unwrap();
            assert_eq!(w.scheme(), scheme, "{proj} of expert {e}");
            assert_eq!((w.out_features, w.in_features), (outf, inf));
            if scheme == "mxfp4" {
                assert_eq!(
                    w.tensors.weight,
                    format!("model.layers.1.mlp.experts.{fused}_blocks[{e}]")
                );
            }
            let got = w.dequantize().unwrap();
            let at = |o: usize, i: usize| {
                if kept_in_out {
                    (e * inf + i) * outf + o
                } else {
                    (e * outf + o) * inf + i
                }
            };
            let bad = (0..outf)
                .flat_map(|o| (0..inf).map(move |i| (o, i)))
                .filter(|&(o, i)| got.data[o * inf + i] != theirs[at(o, i)])
                .count();
            assert_eq!(
                bad, 0,
                "{proj} of expert {e}: values differ from the producer's"
            );
            n += 1;
        }
    }
    n
}

/// gpt-oss as released: `*_blocks` [E, out, in/32, 16] and `*_scales` [E, out, in/32] per fused
/// projection. Experts 0 and 1 of layer 1 resolve to per-expert MXFP4 weights (`w13`, its rows
/// gate/up interleaved as stored; `w2`) whose dequantization equals transformers'
/// `convert_moe_packed_tensors` (kept [E, in, out]), value by value.
#[test]
fn gpt_oss_mxfp4_as_released() {
    let d = dir("gpt_oss", "mxfp4");
    let ck = Checkpoint::open(&d).unwrap();
    let n = layer1_experts_match(&d, &ck, "mxfp4", true);
    assert_eq!(n, 4);
    // the rest is BF16 as released: attention, router, embedding, head
    assert_eq!(ck.weight("layers.1.attn.q_proj").unwrap().scheme(), "bf16");
    assert_eq!(ck.weight("layers.1.ffn.gate").unwrap().scheme(), "bf16");
    lint_clean(&d, "gpt_oss/mxfp4");
}

/// gpt-oss as ModelOpt exports it in NVFP4 (`gpt_oss/modelopt-nvfp4`, made with ModelOpt 0.47.0's
/// own `NVFP4QTensor` in the steps of its BMM-experts export): the fused `gate_up_proj` U8
/// [E, in/2, out] and `_weight_scale` [E, in/16, out] with one `_weight_scale_2` / `_input_scale`
/// scalar per projection resolve to per-expert ModelOpt NVFP4 weights whose dequantization equals
/// ModelOpt's own (kept [E, out, in]), value by value; the attention's plain NVFP4 linears too;
/// lint finds nothing.
#[test]
fn gpt_oss_modelopt_nvfp4_fused_experts() {
    let d = dir("gpt_oss", "modelopt-nvfp4");
    let ck = Checkpoint::open(&d).unwrap();
    let n = layer1_experts_match(&d, &ck, "nvfp4-modelopt", false);
    assert_eq!(n, 4);
    let bytes = std::fs::read(d.join("dequant-layer1.safetensors")).unwrap();
    let deq = SafeTensors::deserialize(&bytes).unwrap();
    for m in ["q_proj", "k_proj", "v_proj", "o_proj"] {
        let t = deq
            .tensor(&format!("model.layers.1.self_attn.{m}.weight"))
            .unwrap();
        let w = ck.weight(&format!("layers.1.attn.{m}")).unwrap();
        assert_eq!(w.scheme(), "nvfp4-modelopt", "{m}");
        assert_eq!(w.dequantize().unwrap().data.to_vec(), f32s(&t), "{m}");
    }
    assert_eq!(ck.weight("layers.1.ffn.gate").unwrap().scheme(), "bf16");
    lint_clean(&d, "gpt_oss/modelopt-nvfp4");
}

/// The command line runs the released-layout checkpoint on the CPU: exit 0, every layer, the
/// routed experts of each read as MXFP4 (the attention BF16), no op diverging and no finding.
#[test]
fn gpt_oss_mxfp4_runs_from_the_command_line() {
    let v = run_report(&dir("gpt_oss", "mxfp4"));
    assert_eq!(v["layers"], serde_json::json!([0, 3]));
    let ops = v["ops"].as_array().unwrap();
    let op = |id: &str| {
        ops.iter()
            .find(|o| o["id"] == id)
            .unwrap_or_else(|| panic!("{id} not run"))
    };
    for n in 0..4 {
        let w = op(&format!("L{n}.ffn.experts"))["weights"]
            .as_array()
            .unwrap();
        assert_eq!(w.len(), 16, "L{n}: w13 and w2 of 8 experts");
        assert!(w.iter().all(|p| p[1] == "mxfp4"), "L{n}: {w:?}");
        assert_eq!(op(&format!("L{n}.attn.q"))["weights"][0][1], "bf16");
    }
    let s = &v["summary"];
    assert_eq!(s["divergent_ops"], 0, "{s}");
    assert_eq!(s["non_finite_ops"], 0, "{s}");
    assert_eq!(s["findings"], serde_json::json!([]), "{s}");
    assert!(op("head")["stats"]["served"]["nan"] == 0);
}

/// gpt-oss as llm-compressor quantizes it with compressed-tensors (`gpt_oss/ct-nvfp4`): the
/// experts as its `LinearExperts` store them, separate gate/up/down linears with biases under
/// `mlp.experts.experts.E`, each an NVFP4 linear of its own. Every kept producer dequantization
/// (layer 1's attention and experts 0 and 1) is matched value by value, lint is clean, and a run
/// reads each expert's gate, up and down as three NVFP4 weights (`w1`, `w3`, `w2`).
#[test]
fn gpt_oss_compressed_tensors_linear_experts() {
    check("gpt_oss", "ct-nvfp4", "nvfp4-ct", 10);
    let d = dir("gpt_oss", "ct-nvfp4");
    let ck = Checkpoint::open(&d).unwrap();
    assert!(
        ck.model_config()
            .unwrap()
            .family
            .as_ref()
            .unwrap()
            .linear_experts
    );
    assert_eq!(
        ck.canonical_of("model.layers.2.mlp.experts.experts.5.up_proj.bias"),
        Some("layers.2.ffn.experts.5.w3.bias")
    );
    let v = run_report(&d);
    let ops = v["ops"].as_array().unwrap();
    for n in 0..4 {
        let id = format!("L{n}.ffn.experts");
        let op = ops.iter().find(|o| o["id"] == id.as_str()).unwrap();
        let w = op["weights"].as_array().unwrap();
        assert_eq!(w.len(), 24, "{id}: w1, w3 and w2 of 8 experts");
        assert!(w.iter().all(|p| p[1] == "nvfp4-ct"), "{id}: {w:?}");
        assert_eq!(w[1][0], format!("layers.{n}.ffn.experts.0.w3"));
    }
    let s = &v["summary"];
    assert_eq!(s["divergent_ops"], 0, "{s}");
    assert_eq!(s["non_finite_ops"], 0, "{s}");
}
