//! gpt-oss as `synth --family gpt-oss` writes it (issue 23): BF16 as transformers saves it and
//! MXFP4 as OpenAI released it (fused experts: `*_blocks`/`*_scales`, gate/up interleaved,
//! `quantization_config: {quant_method: mxfp4, modules_to_not_convert}`), read back exactly, lint
//! clean, and run; its fault catalogue — the loader faults only this layout has (gate/up
//! de-interleaved or interleaved twice, `_scales` not loaded) attributed by `bisect` to
//! `L{n}.ffn.experts` and the right parameter, the checkpoint faults (a left-out `_scales` or
//! `_bias`, a NaN E8M0 byte, rows re-ordered, zeroed biases, a `modules_to_not_convert` that
//! contradicts the tensors) found by `lint`, with `--reference` where the checkpoint's own numbers
//! cannot show it — and the same faults on the producer's own MXFP4 checkpoint
//! (tests/data/hf-families/gpt_oss/mxfp4).

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use nvfp4_probe::bisect::{self, Family};
use nvfp4_probe::checkpoint::{Checkpoint, Dtype};
use nvfp4_probe::model::family::Kind;
use nvfp4_probe::numerics::mxfp4::{self, Mxfp4Rule};
use nvfp4_probe::probe::{synthetic_tokens, RunOptions};
use nvfp4_probe::served::faults::Fault;
use nvfp4_probe::synth::{self, Format, SynthOptions};
use rayon::prelude::*;
use serde_json::{json, Value};
use tempfile::TempDir;

#[path = "safetensors_support/mod.rs"]
mod safetensors_support;
use safetensors_support::{read_all, write_all};

const SEED: u64 = 5;
/// The tiny preset's dimensions (synth::family::gpt_oss): hidden, experts, intermediate.
const D: usize = 256;
const E: usize = 8;
const I: usize = 128;

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

fn opts(format: Format, faults: &[&str]) -> SynthOptions {
    let mut o = SynthOptions::family(Kind::GptOss, format, SEED);
    o.faults = faults.iter().map(|f| Fault::parse(f).unwrap()).collect();
    o
}

fn synth_dir(format: Format, faults: &[&str]) -> TempDir {
    let d = TempDir::new().unwrap();
    synth::synth_to_dir(&opts(format, faults), d.path()).unwrap();
    d
}

/// `lint --json` through the command line: (exit code, findings).
fn lint(model: &Path, reference: Option<&Path>) -> (i32, Vec<Value>) {
    let out = TempDir::new().unwrap();
    let json = out.path().join("lint.json");
    let mut c = bin();
    c.args(["lint", "--model"])
        .arg(model)
        .arg("--json")
        .arg(&json);
    if let Some(r) = reference {
        c.arg("--reference").arg(r);
    }
    let o = c.output().unwrap();
    let code = o.status.code().unwrap();
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    (code, v["findings"].as_array().unwrap().clone())
}

fn show(f: &[Value]) -> String {
    f.iter()
        .map(|f| {
            format!(
                "{} {} {} {} — {}",
                f["severity"], f["rule"], f["tensor"], f["op"], f["evidence"]
            )
        })
        .collect::<Vec<_>>()
        .join("\n")
}

fn errors(f: &[Value]) -> Vec<&Value> {
    f.iter().filter(|f| f["severity"] == "error").collect()
}

/// The porter's commands: `synth --family gpt-oss --format bf16|mxfp4`, `lint` (exit 0, nothing
/// above a note), `run --backend cpu` (exit 0); the release's tensor names, dtypes and shapes,
/// and its quantization config.
#[test]
fn gpt_oss_synthesizes_in_its_release_layouts_lints_clean_and_runs() {
    ["bf16", "mxfp4"].par_iter().for_each(|&format| {
        let tmp = TempDir::new().unwrap();
        let d = tmp.path().join("m");
        bin()
            .args(["synth", "--family", "gpt-oss", "--format", format, "--out"])
            .arg(&d)
            .assert()
            .code(0);
        let (code, findings) = lint(&d, None);
        assert_eq!(code, 0, "{format}:\n{}", show(&findings));
        assert!(
            findings.iter().all(|f| f["severity"] == "info"),
            "{format}:\n{}",
            show(&findings)
        );
        let out = bin()
            .args(["run", "--backend", "cpu", "--quiet", "--model"])
            .arg(&d)
            .output()
            .unwrap();
        assert_eq!(
            out.status.code(),
            Some(0),
            "{format}: {}",
            String::from_utf8_lossy(&out.stdout)
        );
        let ck = Checkpoint::open(&d).unwrap();
        assert_eq!(
            ck.model_config().unwrap().family.as_ref().unwrap().kind,
            Kind::GptOss
        );
        let info = |n: &str| {
            let i = ck.info(n).unwrap_or_else(|| panic!("{format}: no {n}"));
            (i.dtype, i.shape)
        };
        let p = "model.layers.1.mlp.experts";
        let bf = Dtype::BF16;
        assert_eq!(
            info(&format!("{p}.gate_up_proj_bias")),
            (bf, vec![E, 2 * I])
        );
        assert_eq!(info(&format!("{p}.down_proj_bias")), (bf, vec![E, D]));
        assert_eq!(info("model.layers.1.mlp.router.bias"), (bf, vec![E]));
        assert_eq!(info("model.layers.1.self_attn.sinks"), (bf, vec![4]));
        assert_eq!(info("model.layers.1.self_attn.o_proj.bias"), (bf, vec![D]));
        let q = ck.quantization_config().cloned();
        if format == "bf16" {
            assert_eq!(info(&format!("{p}.gate_up_proj")), (bf, vec![E, D, 2 * I]));
            assert_eq!(info(&format!("{p}.down_proj")), (bf, vec![E, I, D]));
            assert!(q.is_none());
        } else {
            let u8_ = Dtype::U8;
            let g = format!("{p}.gate_up_proj");
            assert_eq!(
                info(&format!("{g}_blocks")),
                (u8_, vec![E, 2 * I, D / 32, 16])
            );
            assert_eq!(info(&format!("{g}_scales")), (u8_, vec![E, 2 * I, D / 32]));
            let w2 = format!("{p}.down_proj");
            assert_eq!(info(&format!("{w2}_blocks")), (u8_, vec![E, D, I / 32, 16]));
            assert_eq!(info(&format!("{w2}_scales")), (u8_, vec![E, D, I / 32]));
            assert_eq!(
                q.unwrap(),
                json!({
                    "modules_to_not_convert": [
                        "model.layers.*.self_attn", "model.layers.*.mlp.router",
                        "model.embed_tokens", "lm_head"
                    ],
                    "quant_method": "mxfp4",
                })
            );
            // attention, router, head stay BF16 as the release keeps them
            for n in [
                "model.layers.1.self_attn.q_proj.weight",
                "model.layers.1.mlp.router.weight",
                "lm_head.weight",
            ] {
                assert_eq!(ck.info(n).unwrap().dtype, bf, "{n}");
            }
        }
    });
}

/// E2M1 code to value (OCP MX: sign, 2 exponent bits, 1 mantissa bit), written here from the
/// format's definition.
fn e2m1(c: u8) -> f32 {
    let m = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0][(c & 7) as usize];
    if c & 8 != 0 {
        -m
    } else {
        m
    }
}

fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut n, mut d) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        n += (*x as f64 - *y as f64).powi(2);
        d += (*y as f64).powi(2);
    }
    (n / d).sqrt()
}

fn bf16s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect()
}

/// The MXFP4 release: expert e's slice of `*_blocks` [E, out, in/32, 16] and `*_scales`
/// [E, out, in/32], cut by hand from the fused tensors, holds exactly the bytes the MXFP4
/// quantizer makes of the generated weight (scale 2^ceil(log2(amax/6))); they decode (by hand:
/// low nibble = even element, value · 2^(s − 127); and with numerics' decoder) to what the reader
/// dequantizes, within MXFP4's precision of the generated weight. The interleaved gate/up rows
/// are the canonical `w13`'s, the biases the generated ones, and the BF16 release's
/// `gate_up_proj` [E, D, 2I] is each expert's `w13` transposed.
#[test]
fn mxfp4_experts_decode_to_the_values_synth_encoded() {
    let o = opts(Format::Mxfp4, &[]);
    let ck = synth::synth_to_memory(&o).unwrap();
    let ob = opts(Format::Bf16, &[]);
    let bf = synth::synth_to_memory(&ob).unwrap();
    let mut checked = 0;
    for (layer, e, proj, fused, rows, cols) in [
        (1, 3, "w13", "gate_up_proj", 2 * I, D),
        (1, 3, "w2", "down_proj", D, I),
        (2, 0, "w13", "gate_up_proj", 2 * I, D),
        (3, 7, "w2", "down_proj", D, I),
    ] {
        let p = format!("model.layers.{layer}.mlp.experts.{fused}");
        let base = format!("layers.{layer}.ffn.experts.{e}.{proj}");
        let (nb, wb) = (cols / 32, rows * cols / 2);
        let blocks = &ck.bytes(&format!("{p}_blocks")).unwrap()[e * wb..(e + 1) * wb];
        let scales = &ck.bytes(&format!("{p}_scales")).unwrap()[e * rows * nb..(e + 1) * rows * nb];
        let want = synth::generated(&o, &base).unwrap();
        // the bytes are the quantizer's of the generated weight
        let (qp, qs) = mxfp4::quantize(&want.data, rows, cols, Mxfp4Rule::Ceil);
        assert_eq!((blocks, scales), (&qp[..], &qs[..]), "{base}");
        // decoded by hand from the definition
        let hand: Vec<f32> = (0..rows * cols)
            .map(|k| {
                let b = blocks[k / 2];
                let c = if k % 2 == 0 { b & 0x0F } else { b >> 4 };
                e2m1(c) * 2f32.powi(scales[k / 32] as i32 - 127)
            })
            .collect();
        assert_eq!(
            mxfp4::dequantize(blocks, scales, rows, cols),
            hand,
            "{base}"
        );
        let read = ck.weight(&base).unwrap().dequantize().unwrap();
        assert_eq!(read.shape, vec![rows, cols]);
        assert_eq!(read.data, hand, "{base}: the reader's dequantization");
        // each element is the E2M1 grid point nearest the generated value at its block's scale,
        // and the scale is the smallest power of two that brings the block's amax within 6
        for (k, (&h, &w)) in hand.iter().zip(&want.data).enumerate() {
            let sc = 2f32.powi(scales[k / 32] as i32 - 127);
            let x = w / sc;
            let best = (0u8..16)
                .map(|c| (e2m1(c) - x).abs())
                .fold(f32::MAX, f32::min);
            assert!(
                (h / sc - x).abs() <= best + 1e-6,
                "{base}[{k}]: {h} for {w}"
            );
        }
        for (b, blk) in want.data.chunks(32).enumerate() {
            let amax = blk.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sc = 2f32.powi(scales[b] as i32 - 127);
            assert!(
                amax <= 6.0 * sc && amax > 3.0 * sc,
                "{base} block {b}: amax {amax}, scale {sc}"
            );
        }
        // one mantissa bit, scales rounded up, outlier columns: still near the weight
        let r = rel_l2(&hand, &want.data);
        assert!(r < 0.25, "{base}: rel-L2 {r} to the generated weight");
        // the BF16 release holds the generated weight itself, transposed: [in, out]
        let t = bf16s(
            bf.bytes(&format!("model.layers.{layer}.mlp.experts.{fused}"))
                .unwrap(),
        );
        let slice = &t[e * rows * cols..(e + 1) * rows * cols];
        for (k, w) in want.data.iter().enumerate() {
            assert_eq!(slice[(k % cols) * rows + k / cols], *w, "{base}[{k}]");
        }
        // the bias row of expert e, in both releases
        let bias = synth::generated(&o, &format!("{base}.bias")).unwrap();
        for c in [&ck, &bf] {
            let b = bf16s(c.bytes(&format!("{p}_bias")).unwrap());
            assert_eq!(&b[e * rows..(e + 1) * rows], &bias.data[..], "{base}.bias");
        }
        checked += 1;
    }
    assert_eq!(checked, 4);
}

/// (fault, with the BF16 original as reference, rule, tensor named, op named): each found by
/// `lint` (exit 1), as an error on that tensor and op.
type LintCase = (&'static str, bool, &'static str, &'static str, &'static str);

const LINT: &[LintCase] = &[
    // a NaN E8M0 byte (0xFF) in one expert's block scales
    (
        "nan-block-scale@L1.ffn.expert.3.w2",
        false,
        "scale.block.nan",
        "model.layers.1.mlp.experts.down_proj_scales",
        "L1.ffn.experts",
    ),
    // `_scales` left out beside `_blocks`: an error naming both (the evidence names the blocks)
    (
        "missing-block-scales@L2.ffn.experts",
        false,
        "scale.missing",
        "model.layers.2.mlp.experts.gate_up_proj_scales",
        "L2.ffn.experts",
    ),
    (
        "missing-expert-bias@L1.ffn.experts",
        false,
        "weight.missing",
        "model.layers.1.mlp.experts.down_proj_bias",
        "L1.ffn.experts",
    ),
    // the checkpoint's own numbers cannot show these: against the BF16 original
    (
        "gate-up-deinterleaved@L1.ffn.experts",
        true,
        "reference.row-order",
        "model.layers.1.mlp.experts.gate_up_proj_blocks[4]",
        "L1.ffn.experts",
    ),
    (
        "gate-up-interleaved-twice@L3.ffn.expert.6",
        true,
        "reference.row-order",
        "model.layers.3.mlp.experts.gate_up_proj_bias[6]",
        "L3.ffn.experts",
    ),
    (
        "zeroed-expert-bias@L2.ffn.expert.1",
        true,
        "reference.param",
        "model.layers.2.mlp.experts.down_proj_bias[1]",
        "L2.ffn.experts",
    ),
    (
        "shifted-scale-rows@L1.ffn.expert.5.w13",
        true,
        "reference.block-scales",
        "model.layers.1.mlp.experts.gate_up_proj_blocks[5]",
        "L1.ffn.experts",
    ),
];

#[test]
fn gpt_oss_checkpoint_faults_are_found_by_lint() {
    assert!(LINT.len() >= 5);
    let reference = synth_dir(Format::Bf16, &[]);
    let bad: Vec<String> = LINT
        .par_iter()
        .filter_map(|&(fault, with_ref, rule, tensor, op)| {
            let d = synth_dir(Format::Mxfp4, &[fault]);
            let (code, f) = lint(d.path(), with_ref.then_some(reference.path()));
            let hit = errors(&f)
                .iter()
                .any(|f| f["rule"] == rule && f["tensor"] == tensor && f["op"] == op);
            // a fault the checkpoint's numbers hide is not found without the reference
            let hidden_ok = !with_ref || lint(d.path(), None).0 == 0;
            (code != 1 || !hit || !hidden_ok).then(|| {
                format!(
                    "{fault}: exit {code}, want {rule} on {tensor} [{op}] (clean without reference: {hidden_ok}), got:\n{}",
                    show(&f)
                )
            })
        })
        .collect();
    assert!(bad.is_empty(), "{}", bad.join("\n\n"));
    // the clean MXFP4 checkpoint against the same reference: nothing differs
    let c = synth_dir(Format::Mxfp4, &[]);
    let (code, f) = lint(c.path(), Some(reference.path()));
    assert_eq!(code, 0, "{}", show(&f));
}

/// A converter that stored ModelOpt's NVFP4 `w13` rows in the wrong order: the checkpoint's
/// own numbers are consistent (lint is clean without a reference), the BF16 original shows the
/// rows of the expert it hit moved (the tensor named as stored, transposed: `ᵀ`).
#[test]
fn modelopt_nvfp4_gate_up_order_is_found_against_the_reference() {
    let reference = synth_dir(Format::Bf16, &[]);
    for (fault, tensor) in [
        (
            "gate-up-deinterleaved@L1.ffn.expert.2",
            "model.layers.1.mlp.experts.gate_up_proj[2]ᵀ",
        ),
        (
            "gate-up-interleaved-twice@L3.ffn.expert.6",
            "model.layers.3.mlp.experts.gate_up_proj[6]ᵀ",
        ),
    ] {
        let d = synth_dir(Format::ModelOptNvfp4, &[fault]);
        assert_eq!(lint(d.path(), None).0, 0, "{fault}");
        let (code, f) = lint(d.path(), Some(reference.path()));
        assert_eq!(code, 1, "{fault}: {}", show(&f));
        let e = errors(&f);
        assert!(
            e.iter()
                .any(|f| f["rule"] == "reference.row-order" && f["tensor"] == tensor),
            "{fault}: {}",
            show(&f)
        );
    }
}

/// `missing-block-scales@L2.ffn.experts` planted in `format`: one `scale.missing` error per fused
/// projection of layer 2 on the scale tensor (`{proj}{scale}`), naming the data tensor
/// (`{proj}{data}`) beside it. Returns the evidences.
fn unpaired_scales(format: Format, data: &str, scale: &str) -> Vec<String> {
    let d = synth_dir(format, &["missing-block-scales@L2.ffn.experts"]);
    let (code, f) = lint(d.path(), None);
    assert_eq!(code, 1);
    let e = errors(&f);
    assert_eq!(e.len(), 2, "{}", show(&f));
    let mut out = Vec::new();
    for (proj, f) in ["down_proj", "gate_up_proj"].iter().zip(&e) {
        let ev = f["evidence"].as_str().unwrap();
        let w = format!("model.layers.2.mlp.experts.{proj}");
        let (data, scale) = (format!("`{w}{data}`"), format!("{w}{scale}"));
        assert!(ev.contains(&data) && ev.contains(&scale), "{ev}");
        assert_eq!(f["tensor"], scale);
        assert_eq!(f["rule"], "scale.missing");
        out.push(ev.to_string());
    }
    out
}

/// A fused pair with one half missing is one error naming both tensors, not eight experts'
/// missing pieces under names no file holds; the same for `_blocks` without `_scales`.
#[test]
fn an_unpaired_blocks_or_scales_is_one_error_naming_both() {
    unpaired_scales(Format::Mxfp4, "_blocks", "_scales");
    // the reverse: `_blocks` taken out of the producer's checkpoint, its `_scales` left
    let src = producer();
    let r = strip(&src, &["model.layers.1.mlp.experts.down_proj_blocks"]);
    let (code, f) = lint(r.path(), None);
    assert_eq!(code, 1);
    let e = errors(&f);
    assert_eq!(e.len(), 1, "{}", show(&f));
    assert_eq!(
        (e[0]["rule"].as_str(), e[0]["tensor"].as_str()),
        (
            Some("weight.missing"),
            Some("model.layers.1.mlp.experts.down_proj_blocks")
        )
    );
    assert!(e[0]["evidence"]
        .as_str()
        .unwrap()
        .contains("model.layers.1.mlp.experts.down_proj_scales"));
}

/// ModelOpt's NVFP4 export of gpt-oss with its underscore scale keys left out (what vLLM #46641's
/// loader silently dropped: NaN logits, "!!!!" output): one error per fused projection naming
/// the packed weight and its missing `_weight_scale`; the export as ModelOpt writes it lints
/// clean.
#[test]
fn modelopt_nvfp4_without_its_underscore_scale_keys_is_one_error_per_projection() {
    let clean = synth_dir(Format::ModelOptNvfp4, &[]);
    let (code, f) = lint(clean.path(), None);
    assert_eq!((code, errors(&f).len()), (0, 0), "{}", show(&f));
    for ev in unpaired_scales(Format::ModelOptNvfp4, "", "_weight_scale") {
        assert!(ev.contains("NVFP4") && ev.contains("#46641"), "{ev}");
    }
}

/// `quantization_config.modules_to_not_convert` against the tensors: a listed module stored
/// MXFP4, and an unlisted module (the attention, with its entry dropped) stored BF16, are each
/// a `config.ignore` error naming the tensor; the release's own list is clean.
#[test]
fn modules_to_not_convert_is_checked_against_the_tensors() {
    let edit = |list: Value| -> TempDir {
        let d = synth_dir(Format::Mxfp4, &[]);
        let p = d.path().join("config.json");
        let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        c["quantization_config"]["modules_to_not_convert"] = list;
        std::fs::write(&p, serde_json::to_string(&c).unwrap()).unwrap();
        d
    };
    let d = edit(json!([
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.layers.*.mlp.experts",
        "model.embed_tokens",
        "lm_head"
    ]));
    let (code, f) = lint(d.path(), None);
    assert_eq!(code, 1);
    let e = errors(&f);
    assert!(
        e.iter().all(|f| f["rule"] == "config.ignore")
            && e.iter().any(
                |f| f["tensor"] == "model.layers.2.mlp.experts.gate_up_proj_blocks[3]"
                    && f["op"] == "L2.ffn.experts"
            )
            && e.len() == 4 * 2 * E,
        "{}",
        show(&f)
    );
    let d = edit(json!([
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head"
    ]));
    let (code, f) = lint(d.path(), None);
    assert_eq!(code, 1);
    let e = errors(&f);
    assert!(
        e.iter().all(|f| f["rule"] == "config.ignore")
            && e.iter()
                .any(|f| f["tensor"] == "model.layers.0.self_attn.v_proj.weight"
                    && f["op"] == "L0.attn.v")
            && e.len() == 4 * 4,
        "{}",
        show(&f)
    );
}

/// Which checkpoint a bisect case runs on.
#[derive(Clone, Copy, Debug)]
enum Src {
    /// `synth --family gpt-oss --format mxfp4`
    SynthMxfp4,
    /// the producer's MXFP4 release layout (tests/data/hf-families/gpt_oss/mxfp4)
    Producer,
    /// `synth --family gpt-oss --format modelopt-nvfp4`
    SynthModelOpt,
    /// ModelOpt's own NVFP4 export (tests/data/hf-families/gpt_oss/modelopt-nvfp4)
    ModelOptExport,
}

/// (loader fault, checkpoint, op, verdict kind, parameter family, tensor the verdict names, every
/// base the verdict names starts with this and ends with `end`).
type BisectCase = (
    &'static str,
    Src,
    &'static str,
    &'static str,
    Family,
    &'static str,
    &'static str,
    &'static str,
);

const BISECT: &[BisectCase] = &[
    (
        "gate-up-deinterleaved@L1.ffn.experts",
        Src::SynthMxfp4,
        "L1.ffn.experts",
        "gate-up-interleave",
        Family::GateUpOrder,
        "model.layers.1.mlp.experts.gate_up_proj_blocks",
        "layers.1.ffn.experts.",
        ".w13",
    ),
    (
        "gate-up-interleaved-twice@L2.ffn.experts",
        Src::SynthMxfp4,
        "L2.ffn.experts",
        "gate-up-deinterleave",
        Family::GateUpOrder,
        "model.layers.2.mlp.experts.gate_up_proj_blocks",
        "layers.2.ffn.experts.",
        ".w13",
    ),
    (
        "missing-block-scales@L1.ffn.experts",
        Src::SynthMxfp4,
        "L1.ffn.experts",
        "stored-mxfp4-scales",
        Family::BlockScales,
        "model.layers.1.mlp.experts.gate_up_proj_scales",
        "layers.1.ffn.experts.",
        "",
    ),
    // one expert's w2 scales not loaded: the verdict names that projection alone
    (
        "missing-block-scales@L3.ffn.expert.4.w2",
        Src::SynthMxfp4,
        "L3.ffn.experts",
        "stored-mxfp4-scales",
        Family::BlockScales,
        "model.layers.3.mlp.experts.down_proj_scales",
        "layers.3.ffn.experts.",
        ".w2",
    ),
    // the released layout as the producer's script wrote it
    (
        "gate-up-deinterleaved@L1.ffn.experts",
        Src::Producer,
        "L1.ffn.experts",
        "gate-up-interleave",
        Family::GateUpOrder,
        "model.layers.1.mlp.experts.gate_up_proj_blocks",
        "layers.1.ffn.experts.",
        ".w13",
    ),
    (
        "missing-block-scales@L2.ffn.experts",
        Src::Producer,
        "L2.ffn.experts",
        "stored-mxfp4-scales",
        Family::BlockScales,
        "model.layers.2.mlp.experts.gate_up_proj_scales",
        "layers.2.ffn.experts.",
        "",
    ),
    // ModelOpt's NVFP4 experts: the rows move with their block scales, the scalars stay
    (
        "gate-up-deinterleaved@L1.ffn.experts",
        Src::SynthModelOpt,
        "L1.ffn.experts",
        "gate-up-interleave",
        Family::GateUpOrder,
        "model.layers.1.mlp.experts.gate_up_proj",
        "layers.1.ffn.experts.",
        ".w13",
    ),
    (
        "gate-up-interleaved-twice@L1.ffn.experts",
        Src::ModelOptExport,
        "L1.ffn.experts",
        "gate-up-deinterleave",
        Family::GateUpOrder,
        "model.layers.1.mlp.experts.gate_up_proj",
        "layers.1.ffn.experts.",
        ".w13",
    ),
    (
        "gate-up-deinterleaved@L1.ffn.experts",
        Src::ModelOptExport,
        "L1.ffn.experts",
        "gate-up-interleave",
        Family::GateUpOrder,
        "model.layers.1.mlp.experts.gate_up_proj",
        "layers.1.ffn.experts.",
        ".w13",
    ),
];

fn layer_of(op: &str) -> usize {
    op[1..].split('.').next().unwrap().parse().unwrap()
}

fn bisect_opts(last: usize, vocab: usize, faults: Vec<Fault>) -> RunOptions {
    RunOptions {
        loader_faults: faults,
        ..RunOptions::new((0, last), synthetic_tokens(32, vocab, 7))
    }
}

#[test]
fn gpt_oss_loader_faults_are_attributed_by_bisect() {
    assert!(BISECT.len() >= 5);
    let bad: Vec<String> = BISECT
        .par_iter()
        .filter_map(|&(fault, src, op, kind, fam, tensor, prefix, end)| {
            let (ck, vocab) = match src {
                Src::Producer => (Checkpoint::open(&producer()).unwrap(), 256),
                Src::ModelOptExport => (Checkpoint::open(&modelopt_export()).unwrap(), 256),
                Src::SynthMxfp4 => (synth::synth_to_memory(&opts(Format::Mxfp4, &[])).unwrap(), 512),
                Src::SynthModelOpt => (
                    synth::synth_to_memory(&opts(Format::ModelOptNvfp4, &[])).unwrap(),
                    512,
                ),
            };
            let f = Fault::parse(fault).unwrap();
            let r = bisect::bisect(&ck, &bisect_opts(layer_of(op), vocab, vec![f])).unwrap();
            let got = r.divergence.as_ref().map(|d| {
                (
                    d.op.clone(),
                    d.verdict.as_ref().map(|v| {
                        (
                            v.kind.clone(),
                            v.param.family,
                            v.param.tensors.clone(),
                            v.param.bases.clone(),
                        )
                    }),
                )
            });
            let ok = matches!(&got, Some((o, Some((k, pf, ts, bases))))
                if o == op && k == kind && *pf == fam && ts.first().map(String::as_str) == Some(tensor)
                    && !bases.is_empty()
                    && bases.iter().all(|b| b.starts_with(prefix) && b.ends_with(end)));
            (!ok).then(|| format!("{fault} ({src:?}): {got:?}"))
        })
        .collect();
    assert!(bad.is_empty(), "{bad:#?}");
}

/// vLLM #46641 as a loader fault: ModelOpt's underscore scale keys of gpt-oss's fused NVFP4
/// experts not loaded (block, tensor and activation scales left at 1.0). On synth's export and on
/// ModelOpt's own, bisect stops at that layer's experts and names the stored scales with the
/// engine's mapping as the fix (without it, nothing: `clean_gpt_oss_checkpoints_give_no_bisect_finding`).
#[test]
fn dropped_modelopt_scale_keys_are_attributed_by_bisect() {
    for (ck, vocab) in [
        (
            synth::synth_to_memory(&opts(Format::ModelOptNvfp4, &[])).unwrap(),
            512,
        ),
        (Checkpoint::open(&modelopt_export()).unwrap(), 256),
    ] {
        let f = Fault::parse("missing-block-scales@L1.ffn.experts").unwrap();
        let r = bisect::bisect(&ck, &bisect_opts(1, vocab, vec![f])).unwrap();
        let d = r.divergence.as_ref().expect("a divergence");
        assert_eq!(d.op, "L1.ffn.experts");
        let v = d.verdict.as_ref().expect("a verdict");
        assert_eq!(v.kind, "stored-nvfp4-scales");
        assert_eq!(v.param.family, Family::BlockScales);
        assert_eq!(
            v.param.tensors.first().map(String::as_str),
            Some("model.layers.1.mlp.experts.gate_up_proj_weight_scale")
        );
        assert_eq!(v.param.bases.len(), 16, "{:?}", v.param.bases);
    }
}

/// Without a fault, bisect finds nothing on any release layout, synth's or the producers'.
#[test]
fn clean_gpt_oss_checkpoints_give_no_bisect_finding() {
    for (ck, vocab) in [
        (
            synth::synth_to_memory(&opts(Format::Mxfp4, &[])).unwrap(),
            512,
        ),
        (
            synth::synth_to_memory(&opts(Format::Bf16, &[])).unwrap(),
            512,
        ),
        (
            synth::synth_to_memory(&opts(Format::ModelOptNvfp4, &[])).unwrap(),
            512,
        ),
        (Checkpoint::open(&producer()).unwrap(), 256),
        (Checkpoint::open(&modelopt_export()).unwrap(), 256),
    ] {
        let r = bisect::bisect(&ck, &bisect_opts(3, vocab, vec![])).unwrap();
        assert!(
            !r.has_findings(),
            "{:?} {:?}",
            r.divergence.as_ref().map(|d| &d.op),
            r.findings.iter().map(|f| &f.summary).collect::<Vec<_>>()
        );
    }
}

/// `run --loader-fault FAULT` on `model`, which must refuse it up front (exit 2): its message.
fn refused_run(model: &Path, fault: &str) -> String {
    let out = bin()
        .args([
            "run",
            "--backend",
            "cpu",
            "--quiet",
            "--loader-fault",
            fault,
            "--model",
        ])
        .arg(model)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{fault}");
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// What does not apply is refused up front (exit 2), naming why; nothing is written.
#[test]
fn gpt_oss_faults_that_do_not_apply_are_refused() {
    let refused = |family: Option<&str>, format: &str, fault: &str| -> String {
        let tmp = TempDir::new().unwrap();
        let mut c = bin();
        c.arg("synth");
        if let Some(f) = family {
            c.args(["--family", f]);
        }
        let out = c
            .args(["--format", format, "--fault", fault, "--out"])
            .arg(tmp.path().join("m"))
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{family:?} {format} {fault}");
        assert!(!tmp.path().join("m").exists());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let oss = Some("gpt-oss");
    let m = refused(oss, "mxfp4", "missing-block-scales@L1.ffn.expert.2");
    assert!(m.contains("every expert"), "{m}");
    let m = refused(oss, "bf16", "missing-block-scales@L1.ffn.experts");
    assert!(m.contains("mxfp4"), "{m}");
    let m = refused(oss, "mxfp4", "gate-up-deinterleaved@L1.attn.q");
    assert!(m.contains("routed expert"), "{m}");
    let m = refused(oss, "mxfp4", "swizzled-scales@L1.ffn.experts");
    assert!(m.contains("swizzled"), "{m}");
    let m = refused(oss, "mxfp4", "nan-block-scale@L1.attn.q");
    assert!(m.contains("BF16 weight has no block scales"), "{m}");
    let m = refused(oss, "fp8-block", "nan-block-scale@L1.ffn.experts");
    assert!(m.contains("not one the family ships"), "{m}");
    // llm-compressor's linear experts have no fused tensor to plant into
    for fault in [
        "gate-up-deinterleaved@L1.ffn.experts",
        "missing-expert-bias@L1.ffn.experts",
    ] {
        let m = refused(oss, "ct-nvfp4", fault);
        assert!(m.contains("linear experts"), "{m}");
    }
    let m = refused(
        Some("qwen3-moe"),
        "ct-nvfp4",
        "gate-up-deinterleaved@L1.ffn.experts",
    );
    assert!(m.contains("synth --family gpt-oss"), "{m}");
    let m = refused(None, "mxfp4", "missing-expert-bias@L1.ffn.experts");
    assert!(m.contains("synth --family gpt-oss"), "{m}");
    // loader faults: checkpoint-only kinds, formats served as the oracle reads them, non-w13
    let run = refused_run;
    let mx = synth_dir(Format::Mxfp4, &[]);
    let bf = synth_dir(Format::Bf16, &[]);
    let m = run(mx.path(), "missing-expert-bias@L1.ffn.experts");
    assert!(m.contains("synth --fault"), "{m}");
    let m = run(mx.path(), "gate-up-deinterleaved@L1.ffn.expert.2.w2");
    assert!(m.contains("w13"), "{m}");
    let m = run(bf.path(), "gate-up-deinterleaved@L1.ffn.experts");
    assert!(m.contains("bf16"), "{m}");
    let m = run(bf.path(), "missing-block-scales@L1.ffn.experts");
    assert!(m.contains("bf16"), "{m}");
}

// ---------------------------------------------------------------------------------------------
// The producer's own MXFP4 checkpoint (tests/data/hf-families/gpt_oss/mxfp4).

fn producer() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-families/gpt_oss/mxfp4")
}

/// ModelOpt's own NVFP4 export of the same gpt-oss.
fn modelopt_export() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-families/gpt_oss/modelopt-nvfp4")
}

/// Rewrite a single-file checkpoint's model.safetensors: tensors named in `drop` left out, and
/// `edit` applied to each remaining (name, bytes).
fn rewrite(src: &Path, drop: &[&str], edit: impl Fn(&str, &mut Vec<u8>)) -> TempDir {
    rewrite_named(src, drop, |k| k.to_string(), edit)
}

/// [`rewrite`] with each kept tensor stored under `rename(name)`.
fn rewrite_named(
    src: &Path,
    drop: &[&str],
    rename: impl Fn(&str) -> String,
    edit: impl Fn(&str, &mut Vec<u8>),
) -> TempDir {
    let d = TempDir::new().unwrap();
    std::fs::copy(src.join("config.json"), d.path().join("config.json")).unwrap();
    let out: Vec<_> = read_all(&src.join("model.safetensors"))
        .into_iter()
        .filter(|t| !drop.contains(&t.0.as_str()))
        .map(|(k, dt, shape, mut b)| {
            edit(&k, &mut b);
            (rename(&k), dt, shape, b)
        })
        .collect();
    write_all(&d.path().join("model.safetensors"), &out);
    d
}

fn strip(src: &Path, drop: &[&str]) -> TempDir {
    rewrite(src, drop, |_, _| {})
}

/// The same faults in the producer's bytes: a NaN E8M0 byte, a left-out `_scales`, a left-out
/// `_bias`, each the only error lint reports; the faithful copy lints clean.
#[test]
fn producer_mxfp4_checkpoint_with_a_fault_is_found_by_lint() {
    let src = producer();
    let scales = "model.layers.2.mlp.experts.down_proj_scales";
    let cases: Vec<(TempDir, &str, &str)> = vec![
        (
            rewrite(&src, &[], |k, b| {
                if k == scales {
                    b[40] = 0xFF;
                }
            }),
            "scale.block.nan",
            scales,
        ),
        (
            strip(&src, &["model.layers.1.mlp.experts.gate_up_proj_scales"]),
            "scale.missing",
            "model.layers.1.mlp.experts.gate_up_proj_scales",
        ),
        (
            strip(&src, &["model.layers.3.mlp.experts.gate_up_proj_bias"]),
            "weight.missing",
            "model.layers.3.mlp.experts.gate_up_proj_bias",
        ),
    ];
    for (d, rule, tensor) in &cases {
        let (code, f) = lint(d.path(), None);
        let e = errors(&f);
        assert!(
            code == 1 && e.len() == 1 && e[0]["rule"] == *rule && e[0]["tensor"] == *tensor,
            "{rule} {tensor}:\n{}",
            show(&f)
        );
    }
    let d = strip(&src, &[]);
    let (code, f) = lint(d.path(), None);
    assert_eq!(code, 0, "{}", show(&f));
}

// ---------------------------------------------------------------------------------------------
// The experts' SwiGLU clamp left out by the engine (`swiglu-unclamped`).

/// A synth checkpoint of `format` in `family` (None: V4's tiny preset).
fn synth_dir_of(family: Option<Kind>, format: Format) -> TempDir {
    let d = TempDir::new().unwrap();
    let o = match family {
        Some(k) => SynthOptions::family(k, format, SEED),
        None => SynthOptions::new(
            synth::Preset::Tiny,
            format,
            nvfp4_probe::checkpoint::Naming::Hf,
            SEED,
        ),
    };
    synth::synth_to_dir(&o, d.path()).unwrap();
    d
}

/// [`synth_dir_of`] with the config's `swiglu_limit` set to `limit`: the tiny models' gate and
/// up values stay within a few units, so their own limits (gpt-oss 7, V4 10) never bite; a
/// tight limit makes the clamp part of the numbers.
fn with_limit(family: Option<Kind>, format: Format, limit: f64) -> TempDir {
    let d = synth_dir_of(family, format);
    let p = d.path().join("config.json");
    let mut c: Value = serde_json::from_slice(&std::fs::read(&p).unwrap()).unwrap();
    c["swiglu_limit"] = json!(limit);
    std::fs::write(&p, serde_json::to_vec_pretty(&c).unwrap()).unwrap();
    d
}

/// An MoE kernel not given the config's `swiglu_limit`: where the clamp bites, the experts op
/// (gpt-oss's routed experts; V4's routed and shared experts) is the first divergent op and
/// bisect names the clamp with the config's value as the fix; where it never bites (the tiny
/// models' own limits) nothing shows, and the clean run with the tight limit shows nothing
/// either (every path clamps alike).
#[test]
fn unclamped_swiglu_is_attributed_by_bisect() {
    let cases = [
        (Some(Kind::GptOss), Format::Mxfp4, "L1.ffn.experts"),
        (Some(Kind::GptOss), Format::ModelOptNvfp4, "L1.ffn.experts"),
        (None, Format::CtNvfp4, "L1.ffn.experts"),
        (None, Format::CtNvfp4, "L2.ffn.shared"),
    ];
    for (family, format, op) in cases {
        let d = with_limit(family, format, 1.0);
        let ck = Checkpoint::open(d.path()).unwrap();
        let vocab = ck.model_config().unwrap().vocab_size;
        let last = layer_of(op);
        let clean = bisect::bisect(&ck, &bisect_opts(last, vocab, vec![])).unwrap();
        assert!(!clean.has_findings(), "{family:?} {format:?}: clean");
        let f = Fault::parse(&format!("swiglu-unclamped@{op}")).unwrap();
        let r = bisect::bisect(&ck, &bisect_opts(last, vocab, vec![f.clone()])).unwrap();
        let d0 = r.divergence.as_ref().expect("a divergence");
        assert_eq!(d0.op, op, "{family:?} {format:?}");
        let v = d0.verdict.as_ref().expect("a verdict");
        assert_eq!(
            (v.kind.as_str(), v.param.family),
            ("swiglu-clamp", Family::SwigluClamp)
        );
        assert_eq!(v.param.corrected, Some(1.0));
        // the model's own limit never bites here: the same fault shows nowhere
        let own = Checkpoint::open(synth_dir_of(family, format).path()).unwrap();
        let r = bisect::bisect(&own, &bisect_opts(last, vocab, vec![f])).unwrap();
        assert!(r.divergence.is_none(), "{family:?} {format:?}: own limit");
    }
}

/// `swiglu-unclamped` is refused up front (exit 2) where it cannot be: as a checkpoint fault, on
/// one expert (the clamp is one argument for all of them), on a model without a clamp, on a BF16
/// model (its served path is the BF16 oracle's).
#[test]
fn unclamped_swiglu_is_refused_where_it_cannot_apply() {
    let tmp = TempDir::new().unwrap();
    let out = bin()
        .args([
            "synth", "--family", "gpt-oss", "--format", "mxfp4", "--fault",
        ])
        .arg("swiglu-unclamped@L1.ffn.experts")
        .arg("--out")
        .arg(tmp.path().join("m"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("engine-only"));
    assert!(!tmp.path().join("m").exists());
    let run = refused_run;
    let mx = synth_dir(Format::Mxfp4, &[]);
    let m = run(mx.path(), "swiglu-unclamped@L1.ffn.expert.2");
    assert!(m.contains("one kernel argument"), "{m}");
    let m = run(mx.path(), "swiglu-unclamped@L1.ffn.shared");
    assert!(m.contains("Ln.ffn.experts"), "{m}");
    let qw = synth_dir_of(Some(Kind::Qwen3Moe), Format::CtNvfp4);
    let m = run(qw.path(), "swiglu-unclamped@L1.ffn.experts");
    assert!(m.contains("no SwiGLU clamp"), "{m}");
    let bf = synth_dir(Format::Bf16, &[]);
    let m = run(bf.path(), "swiglu-unclamped@L1.ffn.experts");
    assert!(m.contains("bf16"), "{m}");
}

/// A half-converted gpt-oss checkpoint: one of llm-compressor's `LinearExperts` tensors
/// (`mlp.experts.experts.E.*`) beside the fused experts: refused up front (exit 2) by `lint` and
/// `run`, naming the layouts and a tensor (the whole linear layout is read:
/// tests/gpt_oss_linear.rs).
#[test]
fn mixed_expert_layouts_are_refused_naming_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-families/gpt_oss");
    let d = rewrite_named(
        &src,
        &[],
        |k| {
            k.replace(
                "mlp.experts.down_proj_bias",
                "mlp.experts.experts.0.down_proj.bias",
            )
        },
        |_, _| {},
    );
    for cmd in ["lint", "run"] {
        let out = bin().args([cmd, "--model"]).arg(d.path()).output().unwrap();
        assert_eq!(out.status.code(), Some(2), "{cmd}");
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(
            e.contains("LinearExperts")
                && e.contains("half-converted")
                && e.contains("model.layers.0.mlp.experts.experts.0.down_proj.bias"),
            "{cmd}: {e}"
        );
    }
}
