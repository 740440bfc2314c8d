//! gpt-oss (`GptOssForCausalLM`): the openai/gpt-oss-* layout at tiny size — GQA with q/k/v/o
//! biases and per-head sinks, sliding and full attention alternating, a biased router, routed
//! experts only, each with one fused gate/up projection `w13` (gate and up rows interleaved) and
//! biases. BF16 as transformers' `save_pretrained` writes it, MXFP4 as OpenAI released it.
//!
//! The routed experts are stored fused, one tensor per projection for all of a layer's experts
//! (what `checkpoint::naming`'s interleaved layout reads back per expert): BF16 `gate_up_proj`
//! [E, D, 2I] and `down_proj` [E, I, D] (each expert's weight transposed), MXFP4
//! `gate_up_proj_blocks` [E, 2I, D/32, 16] with `gate_up_proj_scales` [E, 2I, D/32] (U8, E8M0)
//! and the same for `down_proj`, their biases `*_bias` [E, n] in BF16. The experts are planned,
//! generated and encoded one by one like every family's; [`fuse`] stacks their bytes and plants
//! the faults only this layout has (the gate/up row order, a left-out `_scales` or `_bias`).

use serde_json::{json, Map, Value};

use super::super::encode::RawT;
use super::super::plan::{
    lin, param, single, Block, Dims, Format, Group, LinSpec, PDtype, PKind, Role,
};
use super::{norms, FamDims, Spec};
use crate::checkpoint::{transpose, Dtype};
use crate::model::family::Kind;
use crate::served::faults::{deinterleave, interleave, Fault, FaultKind};
use crate::{Error, Result};

pub(super) static SPEC: Spec = Spec {
    kind: Kind::GptOss,
    formats: &[
        Format::Bf16,
        Format::Mxfp4,
        Format::ModelOptNvfp4,
        Format::CtNvfp4,
    ],
    tiny: oss_tiny,
    tiny_layers: 4,
    release: None,
    release_layers: 0,
    layer: oss_layer,
    // the release quantizes the routed experts only (`modules_to_not_convert`: attention, router,
    // embedding, head); ModelOpt's NVFP4_DEFAULT_CFG and llm-compressor's NVFP4 recipe every
    // linear but the router and the head
    quantizes: |f, r| match f {
        Format::Mxfp4 => matches!(r, Role::Expert(_)),
        Format::ModelOptNvfp4 | Format::CtNvfp4 => true,
        _ => false,
    },
    config: oss_config,
    renames: &[
        ("ffn.gate.weight", "mlp.router.weight"),
        ("ffn.gate.bias", "mlp.router.bias"),
    ],
    fuse: Some(fuse),
    // llm-compressor quantizes gpt-oss's experts as its `LinearExperts`
    unfused: &[Format::CtNvfp4],
};

/// Sliding-window length of the sliding layers: a quarter of the 64-token calibration and
/// default prompts, so the window bites.
const WINDOW: usize = 16;

/// The release's `quantization_config.modules_to_not_convert` (openai/gpt-oss-20b, -120b).
pub const NOT_CONVERTED: [&str; 4] = [
    "model.layers.*.self_attn",
    "model.layers.*.mlp.router",
    "model.embed_tokens",
    "lm_head",
];

fn oss_tiny(layers: usize) -> FamDims {
    FamDims {
        hidden: 256,
        layers,
        vocab: 512,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        rope_dim: 64,
        v_head: 64,
        q_lora: 0,
        kv_lora: 0,
        experts: 8,
        topk: 2,
        inter: 128,
        shared: 0,
        first_dense: 0,
        dense_inter: 0,
        n_group: 1,
        topk_group: 1,
        routed_scaling: 1.0,
    }
}

fn bias(name: String, n: usize) -> super::super::plan::ParamSpec {
    param(name, vec![n], PDtype::Bf16, PKind::Bias)
}

/// GQA with biases and sinks; q/k/v one group (engines fuse `qkv_proj`); the router with its
/// bias; per expert `w13` [2I, D] and `w2` [D, I] with their biases, or in compressed-tensors
/// NVFP4 (llm-compressor's `LinearExperts`) gate `w1` and up `w3` [I, D], one group (their
/// global scale shared), and `w2`, each with its bias.
fn oss_layer(d: &FamDims, n: usize, format: Format) -> Block {
    let linear = SPEC.unfused.contains(&format);
    let p = |s: &str| format!("layers.{n}.{s}");
    let (h, hd, i) = (d.hidden, d.head_dim, d.inter);
    let mut params = norms(n, d, &[]);
    params.push(param(
        p("attn.attn_sink"),
        vec![d.heads],
        PDtype::Bf16,
        PKind::Sink,
    ));
    for (w, width) in [
        ("q_proj", d.heads * hd),
        ("k_proj", d.kv_heads * hd),
        ("v_proj", d.kv_heads * hd),
        ("o_proj", h),
    ] {
        params.push(bias(p(&format!("attn.{w}.bias")), width));
    }
    params.push(bias(p("ffn.gate.bias"), d.experts));
    for e in 0..d.experts {
        if linear {
            params.push(bias(p(&format!("ffn.experts.{e}.w1.bias")), i));
            params.push(bias(p(&format!("ffn.experts.{e}.w3.bias")), i));
        } else {
            params.push(bias(p(&format!("ffn.experts.{e}.w13.bias")), 2 * i));
        }
        params.push(bias(p(&format!("ffn.experts.{e}.w2.bias")), h));
    }
    Block {
        layer: Some(n),
        params,
        groups: vec![
            Group {
                members: vec![
                    lin(p("attn.q_proj"), d.heads * hd, h),
                    lin(p("attn.k_proj"), d.kv_heads * hd, h),
                    lin(p("attn.v_proj"), d.kv_heads * hd, h),
                ],
            },
            single(p("attn.o_proj"), h, d.heads * hd),
            single(p("ffn.gate"), d.experts, h),
        ],
        experts: (0..d.experts)
            .map(|e| {
                let q = |w: &str| p(&format!("ffn.experts.{e}.{w}"));
                let gate_up = if linear {
                    Group {
                        members: vec![lin(q("w1"), i, h), lin(q("w3"), i, h)],
                    }
                } else {
                    single(q("w13"), 2 * i, h)
                };
                [gate_up, single(q("w2"), h, i)]
            })
            .collect(),
    }
}

fn oss_config(d: &FamDims) -> Map<String, Value> {
    let types: Vec<&str> = (0..d.layers)
        .map(|l| {
            if l % 2 == 0 {
                "sliding_attention"
            } else {
                "full_attention"
            }
        })
        .collect();
    let v = json!({
        "architectures": ["GptOssForCausalLM"],
        "attention_bias": true,
        "attention_dropout": 0.0,
        "eos_token_id": 1,
        "experts_per_token": d.topk,
        "head_dim": d.head_dim,
        "hidden_act": "silu",
        "hidden_size": d.hidden,
        "initial_context_length": 4096,
        "initializer_range": 0.02,
        "intermediate_size": d.inter,
        "layer_types": types,
        "max_position_embeddings": 131072,
        "model_type": "gpt_oss",
        "num_attention_heads": d.heads,
        "num_experts_per_tok": d.topk,
    });
    let w = json!({
        "num_hidden_layers": d.layers,
        "num_key_value_heads": d.kv_heads,
        "num_local_experts": d.experts,
        "output_router_logits": false,
        "pad_token_id": 0,
        "rms_norm_eps": 1e-5,
        "rope_scaling": {
            "beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": false,
        },
        "rope_theta": 150000,
        "router_aux_loss_coef": 0.9,
        "sliding_window": WINDOW,
        "swiglu_limit": 7.0,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.55.0.dev0",
        "use_cache": true,
        "vocab_size": d.vocab,
    });
    let mut m = v.as_object().cloned().unwrap_or_default();
    m.extend(w.as_object().cloned().unwrap_or_default());
    m
}

/// Refuse, before anything is written, a fused-layout fault that [`fuse`] cannot plant as asked:
/// a kind that leaves a fused tensor out (`_scales`, `_bias`) must cover every expert of a layer
/// (the tensor holds them all); the gate/up orders need a `w13`; `_scales` exist in MXFP4 only;
/// and the swizzled (padded) block-scale layout does not fit the fused `_scales`. The unfused
/// layout (compressed-tensors' linear experts) takes none of the fused kinds.
pub fn check_fault(f: &Fault, lins: &[LinSpec], format: Format) -> Result<()> {
    let refuse = |why: &str| {
        Err(Error::usage(format!(
            "fault {}@{}: {why}",
            f.kind.name(),
            f.target
        )))
    };
    if SPEC.unfused.contains(&format) {
        // each expert under its own names: the other kinds plant as on any per-expert layout
        if f.kind.is_fused_expert() {
            return refuse("plants into the fused experts' tensors, and llm-compressor's linear experts (--format ct-nvfp4) store gate, up and down apart, each with its bias: --format mxfp4, modelopt-nvfp4 or bf16");
        }
        return Ok(());
    }
    if f.kind == FaultKind::SwizzledScales {
        return refuse("gpt-oss's fused `*_scales` [E, out, in/32] cannot hold the padded 128×4-swizzled layout of one expert");
    }
    if !f.kind.is_fused_expert() {
        return Ok(());
    }
    if f.kind == FaultKind::MissingBlockScales
        && !matches!(format, Format::Mxfp4 | Format::ModelOptNvfp4)
    {
        return refuse("needs fused block scales (MXFP4 `*_scales`, ModelOpt NVFP4 `*_weight_scale`): --format mxfp4 or modelopt-nvfp4");
    }
    let hit: Vec<&LinSpec> = lins.iter().filter(|l| f.hits(&l.base)).collect();
    if !hit.iter().any(|l| l.base.contains(".ffn.experts.")) {
        return refuse("the target matches no routed expert of this gpt-oss checkpoint (targets like L1.ffn.experts, L1.ffn.expert.3)");
    }
    if f.kind.is_gate_up_order() && !hit.iter().any(|l| l.base.ends_with(".w13")) {
        return refuse("needs the fused gate/up projection `w13` (targets like L1.ffn.experts, L1.ffn.expert.3.w13)");
    }
    if matches!(
        f.kind,
        FaultKind::MissingBlockScales | FaultKind::MissingExpertBias
    ) && !lins
        .iter()
        .filter_map(|l| projection_of(&l.base))
        .any(|(layer, proj)| covers_all(f, lins, layer, proj))
    {
        return refuse("leaves a fused tensor out, and a fused tensor holds every expert of a layer: target all of them (L1.ffn.experts)");
    }
    Ok(())
}

/// (layer, projection) of a routed expert's base: `layers.1.ffn.experts.3.w13` → (1, "w13").
pub(crate) fn projection_of(base: &str) -> Option<(usize, &str)> {
    let rest = base.strip_prefix("layers.")?;
    let (n, tail) = rest.split_once(".ffn.experts.")?;
    let (_, proj) = tail.split_once('.')?;
    Some((n.parse().ok()?, proj))
}

/// Whether `f` hits projection `proj` of every expert of `layer`.
fn covers_all(f: &Fault, lins: &[LinSpec], layer: usize, proj: &str) -> bool {
    let mut of_layer = lins
        .iter()
        .filter(|l| projection_of(&l.base) == Some((layer, proj)))
        .peekable();
    of_layer.peek().is_some() && of_layer.all(|l| f.hits(&l.base))
}

/// One layer's routed experts as encoded one by one, to be stored fused.
pub struct FuseIn<'a> {
    pub layer: usize,
    pub dims: &'a Dims,
    pub format: Format,
    /// Every expert's encoded tensors (canonical names: `layers.1.ffn.experts.3.w13.weight`, …).
    pub experts: Vec<RawT>,
    /// The layer's expert biases (canonical names), as generated.
    pub params: Vec<RawT>,
    pub faults: &'a [Fault],
}

/// Stack one layer's experts into the release's fused tensors (raw names), planting the
/// fused-layout faults: `w13`'s rows (weight, block scales, bias) re-ordered per expert hit, a
/// `_scales` or `_bias` tensor left out when its projection is hit in every expert, an expert's
/// bias zeroed.
pub fn fuse(f: &FuseIn) -> Result<Vec<RawT>> {
    let (l, e) = (f.layer, f.dims.experts);
    let (d, i) = (f.dims.hidden, f.dims.inter);
    let prefix = format!("model.layers.{l}.mlp.experts");
    let find = |set: &[RawT], name: &str| -> Result<Vec<u8>> {
        set.iter()
            .find(|t| t.name == name)
            .map(|t| t.bytes.clone())
            .ok_or_else(|| {
                Error::usage(format!(
                    "synth: gpt-oss expert tensor `{name}` was not encoded"
                ))
            })
    };
    let base = |ex: usize, proj: &str| format!("layers.{l}.ffn.experts.{ex}.{proj}");
    let hits = |k: FaultKind, ex: usize, proj: &str| {
        f.faults
            .iter()
            .any(|x| x.kind == k && x.hits(&base(ex, proj)))
    };
    let every = |k: FaultKind, proj: &str| (0..e).all(|ex| hits(k, ex, proj));
    // w13's rows as a loader-independent converter bug stores them
    let order = |ex: usize, proj: &str, v: Vec<u8>, rows: usize| -> Vec<u8> {
        if proj != "w13" {
            v
        } else if hits(FaultKind::GateUpDeinterleaved, ex, proj) {
            deinterleave(&v, rows)
        } else if hits(FaultKind::GateUpInterleavedTwice, ex, proj) {
            interleave(&v, rows)
        } else {
            v
        }
    };
    let mut out = Vec::new();
    // (projection, fused name, rows = out features, cols = in features)
    for (proj, name, rows, cols) in [("w13", "gate_up_proj", 2 * i, d), ("w2", "down_proj", d, i)] {
        let mxfp4 = f.format == Format::Mxfp4;
        let modelopt = f.format == Format::ModelOptNvfp4;
        let mut data = Vec::new();
        let mut scales = Vec::new();
        let mut biases = Vec::new();
        // ModelOpt's tensor scales, per expert (None: an expert's input_scale left out)
        let (mut globals, mut inputs) = (Vec::new(), Vec::new());
        for ex in 0..e {
            let w = find(&f.experts, &format!("{}.weight", base(ex, proj)))?;
            let w = order(ex, proj, w, rows);
            if mxfp4 {
                data.extend(w);
                let s = find(&f.experts, &format!("{}.weight_scale", base(ex, proj)))?;
                scales.extend(order(ex, proj, s, rows));
            } else if modelopt {
                // ModelOpt quantizes each expert's [out, in] and stores the packed bytes and
                // block scales transposed back to transformers' [in, out]: [in/2, out], [in/16, out]
                data.extend(transpose(&w, rows, cols / 2));
                let s = find(&f.experts, &format!("{}.weight_scale", base(ex, proj)))?;
                let nb = cols / crate::numerics::nvfp4::BLOCK;
                scales.extend(transpose(&order(ex, proj, s, rows), rows, nb));
                globals.push(find(
                    &f.experts,
                    &format!("{}.weight_scale_2", base(ex, proj)),
                )?);
                inputs.push(find(&f.experts, &format!("{}.input_scale", base(ex, proj))).ok());
            } else {
                // transformers' BF16 layout is each expert's [out, in] transposed: [in, out]
                data.extend(transpose_bf16(&w, rows, cols));
            }
            let b = find(&f.params, &format!("{}.bias", base(ex, proj)))?;
            let b = order(ex, proj, b, rows);
            if hits(FaultKind::ZeroedExpertBias, ex, proj) {
                biases.extend(vec![0u8; b.len()]);
            } else {
                biases.extend(b);
            }
        }
        let t = |suffix: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>| RawT {
            name: format!("{prefix}.{name}{suffix}"),
            raw: true,
            dtype,
            shape,
            bytes,
        };
        if mxfp4 {
            let nb = cols / crate::numerics::mxfp4::BLOCK;
            out.push(t("_blocks", Dtype::U8, vec![e, rows, nb, 16], data));
            if !every(FaultKind::MissingBlockScales, proj) {
                out.push(t("_scales", Dtype::U8, vec![e, rows, nb], scales));
            }
        } else if modelopt {
            let nb = cols / crate::numerics::nvfp4::BLOCK;
            out.push(t("", Dtype::U8, vec![e, cols / 2, rows], data));
            // vLLM #46641: the underscore scale keys a loader must map, all left out here
            if !every(FaultKind::MissingBlockScales, proj) {
                out.push(t(
                    "_weight_scale",
                    Dtype::F8_E4M3,
                    vec![e, nb, rows],
                    scales,
                ));
                out.push(shared_scalar(t, "_weight_scale_2", globals)?);
                if inputs.iter().all(Option::is_some) {
                    out.push(shared_scalar(
                        t,
                        "_input_scale",
                        inputs.into_iter().flatten().collect(),
                    )?);
                } else if inputs.iter().any(Option::is_some) {
                    return Err(Error::usage(format!(
                        "synth: {prefix}.{name}_input_scale is one tensor for every expert: a missing input scale must hit all of them (L{l}.ffn.experts)"
                    )));
                }
            }
        } else {
            out.push(t("", Dtype::BF16, vec![e, cols, rows], data));
        }
        if !every(FaultKind::MissingExpertBias, proj) {
            out.push(t("_bias", Dtype::BF16, vec![e, rows], biases));
        }
    }
    Ok(out)
}

/// ModelOpt's tensor scale of a fused projection: one F32 scalar when every expert's is the same
/// (one quantizer for the whole tensor, as ModelOpt calibrates it), else one per expert [E] (a
/// fault planted in some experts only).
fn shared_scalar(
    t: impl Fn(&str, Dtype, Vec<usize>, Vec<u8>) -> RawT,
    suffix: &str,
    per_expert: Vec<Vec<u8>>,
) -> Result<RawT> {
    let first = per_expert
        .first()
        .cloned()
        .ok_or_else(|| Error::usage("synth: a fused projection without experts"))?;
    Ok(if per_expert.iter().all(|b| *b == first) {
        t(suffix, Dtype::F32, vec![], first)
    } else {
        let n = per_expert.len();
        t(suffix, Dtype::F32, vec![n], per_expert.concat())
    })
}

/// The bytes of a row-major BF16 [rows, cols] matrix transposed to [cols, rows].
fn transpose_bf16(b: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; b.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (s, t) = (2 * (r * cols + c), 2 * (c * rows + r));
            out[t..t + 2].copy_from_slice(&b[s..s + 2]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transpose_moves_bf16_elements() {
        // [[a, b, c], [d, e, f]] as two-byte elements → [[a, d], [b, e], [c, f]]
        let m: Vec<u8> = (0u8..12).collect();
        let t = transpose_bf16(&m, 2, 3);
        assert_eq!(t, [0, 1, 6, 7, 2, 3, 8, 9, 4, 5, 10, 11]);
    }

    #[test]
    fn projections_and_coverage() {
        assert_eq!(
            projection_of("layers.12.ffn.experts.3.w13"),
            Some((12, "w13"))
        );
        assert_eq!(projection_of("layers.1.attn.q_proj"), None);
        let lins: Vec<LinSpec> = (0..3)
            .flat_map(|e| ["w13", "w2"].map(|p| lin(format!("layers.1.ffn.experts.{e}.{p}"), 4, 4)))
            .collect();
        let f = |t: &str| Fault::parse(&format!("missing-expert-bias@{t}")).unwrap();
        assert!(covers_all(&f("L1.ffn.experts"), &lins, 1, "w13"));
        assert!(!covers_all(&f("L1.ffn.expert.1"), &lins, 1, "w13"));
        assert!(!covers_all(&f("L1.ffn.experts"), &lins, 2, "w13"));
        let fmt = Format::Mxfp4;
        assert!(check_fault(&f("L1.ffn.experts"), &lins, fmt).is_ok());
        let e = check_fault(&f("L1.ffn.expert.1"), &lins, fmt).unwrap_err();
        assert!(e.to_string().contains("every expert"), "{e}");
        let s = Fault::parse("missing-block-scales@L1.ffn.experts").unwrap();
        assert!(check_fault(&s, &lins, Format::Bf16).is_err());
        let g = Fault::parse("gate-up-deinterleaved@L1.ffn.expert.2.w2").unwrap();
        assert!(check_fault(&g, &lins, fmt)
            .unwrap_err()
            .to_string()
            .contains("w13"));
        let g = Fault::parse("gate-up-deinterleaved@L1.ffn.expert.2").unwrap();
        assert!(check_fault(&g, &lins, fmt).is_ok());
    }
}
