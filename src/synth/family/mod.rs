//! Synthetic checkpoints of the model families beyond DeepSeek-V4 (issue 23): `synth --family
//! qwen3-moe|deepseek-v3|gpt-oss`, in the family's real on-disk layout (transformers' names as
//! the hub releases store them: one tensor per expert projection, or gpt-oss's fused experts) and
//! in each format the family ships.
//!
//! A family is one row of [`TABLE`] ([`Spec`]): its tiny dimensions, its canonical tensor list
//! (the names `checkpoint::naming` maps its transformers names onto, the weights
//! `model::family::graph` reads), which linears each format quantizes, its `config.json`, and the
//! few canonical names whose transformers spelling differs from V4's. Everything else is V4's
//! machinery unchanged: the generator (`gen`: trained-model structure, routers aimed at token
//! clusters), the calibration (`calib`: the family's own FP32 forward through its op graph), the
//! encoders and planted faults (`encode`), the writer. A family whose release fuses its experts
//! (gpt-oss: `gate_up_proj` [E, D, 2I] in BF16, `*_blocks`/`*_scales` in MXFP4) has a
//! [`Spec::fuse`] that stacks the experts' encoded bytes into its tensors and plants the faults
//! only that layout has.
//!
//! One file per family (`qwen3_moe.rs`, `deepseek_v3.rs`, `gpt_oss.rs`: its row, dimensions,
//! layer and config);
//! the faults that change parameters rather than linear weights (a dropped
//! `e_score_correction_bias`, swapped `q_norm`/`k_norm`) are planted by [`params`].

mod deepseek_v3;
pub mod gpt_oss;
pub mod params;
mod qwen3_moe;

use serde_json::{json, Map, Value};

use super::encode::RawT;
use super::plan::{self, lin, param, single, Block, Dims, Format, Group, PDtype, PKind, Role};
use super::plan::{ParamSpec, WScheme};
use crate::checkpoint::Naming;
use crate::model::family::Kind;
use crate::{Error, Result};

pub use params::{check_param_fault, is_param_fault, plant_params};

/// One family's synthetic checkpoint, as data.
pub struct Spec {
    pub kind: Kind,
    /// The `--format`s the family's releases ship.
    pub formats: &'static [Format],
    /// The tiny preset at `layers` layers.
    tiny: fn(usize) -> FamDims,
    /// Layers of the tiny preset without `--layers`.
    pub tiny_layers: usize,
    /// The released model's dimensions at `layers` layers (`--preset release`), if synthesized.
    release: Option<fn(usize) -> FamDims>,
    /// Layers of the release preset without `--layers`.
    release_layers: usize,
    /// One layer's canonical tensors in a format (the model-level block is shared:
    /// [`model_block`]).
    layer: fn(&FamDims, usize, Format) -> Block,
    /// Whether `format` quantizes a linear of this role (routers and the head never are).
    quantizes: fn(Format, Role) -> bool,
    /// `config.json` without `quantization_config`, as the hub release writes it.
    config: fn(&FamDims) -> Map<String, Value>,
    /// Canonical layer tails (after `layers.N.`) whose transformers name is not V4's HF spelling.
    renames: &'static [(&'static str, &'static str)],
    /// The release stores the routed experts fused: one layer's experts (encoded one by one)
    /// and their `.ffn.experts.` parameters into the release's tensors, raw names. None: each
    /// expert's tensors under their own names.
    pub fuse: Option<FuseFn>,
    /// Formats whose producer stores each expert under its own names although the release
    /// fuses them (llm-compressor's gpt-oss `LinearExperts` in compressed-tensors NVFP4).
    pub unfused: &'static [Format],
}

/// Stacks one layer's encoded experts into a release's fused tensors ([`Spec::fuse`]).
pub type FuseFn = fn(&gpt_oss::FuseIn) -> Result<Vec<RawT>>;

/// The families `synth --family` writes; a new family is a new row.
pub static TABLE: &[&Spec] = &[&qwen3_moe::SPEC, &deepseek_v3::SPEC, &gpt_oss::SPEC];

/// The row of a family kind.
pub fn spec(kind: Kind) -> Result<&'static Spec> {
    TABLE
        .iter()
        .copied()
        .find(|s| s.kind == kind)
        .ok_or_else(|| Error::usage(format!("synth: no synthetic {} yet", kind.label())))
}

/// The family a `--family` name names.
pub fn parse(s: &str) -> Result<Kind> {
    TABLE
        .iter()
        .map(|f| f.kind)
        .find(|k| k.label() == s)
        .ok_or_else(|| {
            let names: Vec<&str> = TABLE.iter().map(|f| f.kind.label()).collect();
            Error::usage(format!(
                "unknown family `{s}` (known: {})",
                names.join(", ")
            ))
        })
}

/// A family model's dimensions (the fields a family does not have are 0).
#[derive(Clone, Debug, PartialEq)]
pub struct FamDims {
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    pub heads: usize,
    pub kv_heads: usize,
    /// q/k head width (DeepSeek-V3: nope + rope).
    pub head_dim: usize,
    pub rope_dim: usize,
    pub v_head: usize,
    pub q_lora: usize,
    pub kv_lora: usize,
    pub experts: usize,
    pub topk: usize,
    pub inter: usize,
    pub shared: usize,
    /// Leading dense layers and their MLP width.
    pub first_dense: usize,
    pub dense_inter: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling: f64,
}

impl FamDims {
    /// The generator's view (`gen` reads the sizes, experts and top-k; the V4-only fields stay 0).
    pub fn gen_dims(&self) -> Dims {
        Dims {
            hidden: self.hidden,
            layers: self.layers,
            vocab: self.vocab,
            heads: self.heads,
            head_dim: self.head_dim,
            rope_dim: self.rope_dim,
            q_lora: self.q_lora,
            o_groups: 0,
            o_lora: 0,
            window: 0,
            hca: 0,
            ratios: vec![0; self.layers],
            experts: self.experts,
            topk: self.topk,
            shared: self.shared,
            inter: self.inter,
            hash_layers: 0,
            index_heads: 0,
            index_dim: 0,
            index_topk: 0,
            routed_scaling: self.routed_scaling,
            hc: 0,
            sinkhorn: 0,
        }
    }
}

impl Spec {
    /// The dimensions of `preset` (tiny, or the release's) at `layers` layers.
    pub fn dims(&self, preset: plan::Preset, layers: Option<usize>) -> Result<FamDims> {
        let (make, default) = match (preset, self.release) {
            (plan::Preset::Release, Some(r)) => (r, self.release_layers),
            (plan::Preset::Release, None) => {
                return Err(Error::usage(format!(
                    "synth --family {}: no --preset release yet (tiny only)",
                    self.kind.label()
                )))
            }
            _ => (self.tiny, self.tiny_layers),
        };
        let n = layers.unwrap_or(default);
        if n == 0 || n > 64 {
            return Err(Error::usage(format!("--layers {n}: must be in 1..=64")));
        }
        Ok(make(n))
    }

    /// The canonical tensor list in `format`: the model-level block, then one block per layer.
    pub fn blocks(&self, d: &FamDims, format: Format) -> Vec<Block> {
        let mut v = vec![model_block(d)];
        v.extend((0..d.layers).map(|n| (self.layer)(d, n, format)));
        v
    }

    /// How `format` stores the routed experts: fused by the release's [`Spec::fuse`], or (None,
    /// or a format in [`Spec::unfused`]) each expert under its own names.
    pub fn fuse_in(&self, format: Format) -> Option<FuseFn> {
        self.fuse.filter(|_| !self.unfused.contains(&format))
    }

    /// How linear `base` is stored in `format`.
    pub fn scheme(&self, format: Format, base: &str) -> WScheme {
        let r = plan::role(base);
        if matches!(r, Role::Router | Role::Head) || !(self.quantizes)(format, r) {
            return WScheme::Bf16;
        }
        match format {
            Format::CtNvfp4 => WScheme::Nvfp4Ct,
            Format::ModelOptNvfp4 => WScheme::Nvfp4ModelOpt,
            Format::Fp8Block => WScheme::Fp8F32,
            Format::Mxfp4 => WScheme::Mxfp4,
            _ => WScheme::Bf16,
        }
    }

    /// The transformers name of a canonical tensor.
    pub fn raw_name(&self, canonical: &str) -> String {
        if let Some((n, tail)) = canonical
            .strip_prefix("layers.")
            .and_then(|r| r.split_once('.'))
        {
            if let Some((_, to)) = self.renames.iter().find(|(from, _)| *from == tail) {
                return format!("model.layers.{n}.{to}");
            }
        }
        let raw = plan::raw_name(canonical, Naming::Hf);
        // gpt-oss's experts unfused (llm-compressor's `LinearExperts`): `mlp.experts.experts.E`
        match raw.split_once(".mlp.experts.") {
            Some((a, b)) if self.fuse.is_some() && b.starts_with(|c: char| c.is_ascii_digit()) => {
                format!("{a}.mlp.experts.experts.{b}")
            }
            _ => raw,
        }
    }

    /// `config.json` and (ModelOpt) `hf_quant_config.json`.
    pub fn config_files(
        &self,
        d: &FamDims,
        format: Format,
        blocks: &[Block],
    ) -> (String, Option<String>) {
        let mut m = (self.config)(d);
        let bf16_modules = || -> Vec<String> {
            plan::all_linears(blocks)
                .iter()
                .filter(|l| self.scheme(format, &l.base) == WScheme::Bf16)
                .map(|l| {
                    let w = self.raw_name(&format!("{}.weight", l.base));
                    w.strip_suffix(".weight").map(str::to_string).unwrap_or(w)
                })
                .collect()
        };
        let mut hq = None;
        match format {
            // llm-compressor's NVFP4 preset, as tests/data/hf-families/*/ct-nvfp4 holds it
            Format::CtNvfp4 => {
                // `mlp.gate`, gpt-oss's `mlp.router`
                let w = self.raw_name("layers.0.ffn.gate.weight");
                let router = w
                    .strip_prefix("model.layers.0.")
                    .and_then(|r| r.strip_suffix(".weight"))
                    .unwrap_or("mlp.gate");
                let args = |dynamic: Value, observer: bool| {
                    let mut a = json!({
                        "num_bits": 4, "type": "float", "symmetric": true, "group_size": 16,
                        "strategy": "tensor_group", "dynamic": dynamic,
                        "scale_dtype": "torch.float8_e4m3fn",
                    });
                    if observer {
                        a["observer"] = json!("static_minmax");
                    }
                    a
                };
                m.insert(
                    "quantization_config".into(),
                    json!({
                        "config_groups": {"group_0": {
                            "targets": ["Linear"],
                            "weights": args(json!(false), false),
                            "input_activations": args(json!("local"), true),
                            "output_activations": null,
                            "format": "nvfp4-pack-quantized",
                        }},
                        "quant_method": "compressed-tensors",
                        "kv_cache_scheme": null,
                        "format": "nvfp4-pack-quantized",
                        "quantization_status": "compressed",
                        "global_compression_ratio": null,
                        "ignore": ["lm_head", format!("re:.*{router}$")],
                        "moe_sparsity_config": null,
                        "version": "0.20.0",
                    }),
                );
            }
            Format::ModelOptNvfp4 => {
                let ex = bf16_modules();
                m.insert(
                    "quantization_config".into(),
                    json!({
                        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
                        "kv_cache_quant_algo": null, "exclude_modules": ex,
                    }),
                );
                hq = Some(json!({
                    "producer": {"name": "modelopt", "version": "0.47.0"},
                    "quantization": {
                        "quant_algo": "NVFP4", "kv_cache_quant_algo": null, "group_size": 16,
                        "exclude_modules": ex,
                    },
                }));
            }
            // DeepSeek-V3's own release
            Format::Fp8Block => {
                m.insert(
                    "quantization_config".into(),
                    json!({
                        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                        "weight_block_size": [128, 128],
                    }),
                );
            }
            // OpenAI's gpt-oss release
            Format::Mxfp4 => {
                m.insert(
                    "quantization_config".into(),
                    json!({
                        "modules_to_not_convert": gpt_oss::NOT_CONVERTED,
                        "quant_method": "mxfp4",
                    }),
                );
            }
            _ => {}
        }
        let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_else(|_| "{}".into());
        (pretty(&Value::Object(m)), hq.as_ref().map(pretty))
    }
}

/// Embedding, final norm and the (untied) head.
fn model_block(d: &FamDims) -> Block {
    let (h, v) = (d.hidden, d.vocab);
    Block {
        layer: None,
        params: vec![
            param(
                "embed.weight".into(),
                vec![v, h],
                PDtype::Bf16,
                PKind::Embed,
            ),
            param("norm.weight".into(), vec![h], PDtype::Bf16, PKind::Norm),
        ],
        groups: vec![single("head".into(), v, h)],
        experts: Vec::new(),
    }
}

/// The FFN side every family shares: a dense MLP (gate/up fused, then down), or the router, the
/// shared expert (gate/up fused) when there is one, and the routed experts.
fn ffn(d: &FamDims, n: usize, dense: bool, b: &mut Block) {
    let p = |s: &str| format!("layers.{n}.{s}");
    let h = d.hidden;
    if dense {
        b.groups.push(Group {
            members: vec![
                lin(p("ffn.gate_proj"), d.dense_inter, h),
                lin(p("ffn.up_proj"), d.dense_inter, h),
            ],
        });
        b.groups.push(single(p("ffn.down_proj"), h, d.dense_inter));
        return;
    }
    b.groups.push(single(p("ffn.gate"), d.experts, h));
    if d.shared > 0 {
        let si = d.inter * d.shared;
        b.groups.push(Group {
            members: vec![
                lin(p("ffn.shared_experts.w1"), si, h),
                lin(p("ffn.shared_experts.w3"), si, h),
            ],
        });
        b.groups.push(single(p("ffn.shared_experts.w2"), h, si));
    }
    b.experts = (0..d.experts)
        .map(|e| {
            let q = |w: &str| p(&format!("ffn.experts.{e}.{w}"));
            [
                Group {
                    members: vec![lin(q("w1"), d.inter, h), lin(q("w3"), d.inter, h)],
                },
                single(q("w2"), h, d.inter),
            ]
        })
        .collect();
}

fn norms(n: usize, d: &FamDims, extra: &[(&str, usize)]) -> Vec<ParamSpec> {
    let mut v = vec![
        param(
            format!("layers.{n}.attn_norm.weight"),
            vec![d.hidden],
            PDtype::Bf16,
            PKind::Norm,
        ),
        param(
            format!("layers.{n}.ffn_norm.weight"),
            vec![d.hidden],
            PDtype::Bf16,
            PKind::Norm,
        ),
    ];
    for (name, w) in extra {
        v.push(param(
            format!("layers.{n}.{name}"),
            vec![*w],
            PDtype::Bf16,
            PKind::Norm,
        ));
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::naming::{canonical, Canon};
    use crate::model::{build_graph, ModelConfig};

    /// Every canonical tensor's transformers name maps back through the reader's own (separately
    /// written) HF rules, and the config is the family the parser detects.
    #[test]
    fn names_round_trip_and_configs_parse() {
        for s in TABLE {
            let d = s.dims(plan::Preset::Tiny, None).unwrap();
            for f in s.formats {
                let bl = s.blocks(&d, *f);
                let mut names: Vec<String> = bl
                    .iter()
                    .flat_map(|b| b.params.iter().map(|p| p.name.clone()))
                    .collect();
                for l in plan::all_linears(&bl) {
                    for leaf in ["weight", "weight_packed", "input_scale", "weight_scale_inv"] {
                        names.push(format!("{}.{leaf}", l.base));
                    }
                }
                // a release that fuses its experts names them per layer (checked below)
                for c in names
                    .iter()
                    .filter(|c| s.fuse_in(*f).is_none() || !c.contains(".ffn.experts."))
                {
                    let raw = s.raw_name(c);
                    assert_eq!(
                        canonical(&raw, Naming::Hf),
                        Canon::Plain(c.clone()),
                        "{raw}"
                    );
                }
                let (cfg, _) = s.config_files(&d, *f, &bl);
                let v: Value = serde_json::from_str(&cfg).unwrap();
                let mut mc = ModelConfig::from_json(&v).unwrap();
                assert_eq!(mc.family.as_ref().unwrap().kind, s.kind);
                // what the reader sets from the tensors: gpt-oss's experts unfused
                mc.family
                    .as_mut()
                    .unwrap()
                    .note_expert_names(names.iter().map(String::as_str));
                // every weight the graph reads is planned
                let planned: Vec<String> = plan::all_linears(&bl)
                    .into_iter()
                    .map(|l| l.base)
                    .chain(names.iter().cloned())
                    .collect();
                for op in build_graph(&mc, d.layers - 1, true) {
                    for w in op.weights.iter().filter(|w| *w != "embed") {
                        assert!(
                            planned.contains(w),
                            "{} {f:?} {w} not planned",
                            s.kind.label()
                        );
                    }
                }
            }
        }
        let q = spec(Kind::Qwen3Moe).unwrap();
        assert_eq!(
            q.raw_name("layers.2.attn.q_norm.weight"),
            "model.layers.2.self_attn.q_norm.weight"
        );
        let v = spec(Kind::DeepseekV3).unwrap();
        assert_eq!(
            v.raw_name("layers.1.ffn.gate.bias"),
            "model.layers.1.mlp.gate.e_score_correction_bias"
        );
        assert_eq!(
            v.raw_name("layers.1.attn.kv_norm.weight"),
            "model.layers.1.self_attn.kv_a_layernorm.weight"
        );
    }

    /// `--preset release` of DeepSeek-V3: the released dimensions in a config the reader takes
    /// (two layers: one dense, one of 256 experts × 2048, top 8), every weight the graph reads
    /// planned; the other families refuse it.
    #[test]
    fn deepseek_v3_release_preset_has_the_released_dimensions() {
        let s = spec(Kind::DeepseekV3).unwrap();
        let d = s.dims(plan::Preset::Release, None).unwrap();
        let bl = s.blocks(&d, Format::ModelOptNvfp4);
        let (cfg, _) = s.config_files(&d, Format::ModelOptNvfp4, &bl);
        let mc = ModelConfig::from_json(&serde_json::from_str(&cfg).unwrap()).unwrap();
        assert_eq!(mc.num_hidden_layers, 2);
        assert_eq!(mc.hidden_size, 7168);
        assert_eq!(mc.n_routed_experts, 256);
        assert_eq!(mc.num_experts_per_tok, 8);
        assert_eq!(mc.moe_intermediate_size, 2048);
        assert_eq!(mc.num_attention_heads, 128);
        assert_eq!(mc.vocab_size, 129280);
        let experts: Vec<String> = plan::all_linears(&bl)
            .into_iter()
            .filter(|l| l.base.starts_with("layers.1.ffn.experts."))
            .map(|l| l.base)
            .collect();
        assert_eq!(experts.len(), 256 * 3);
        assert!(!plan::all_linears(&bl)
            .iter()
            .any(|l| l.base.starts_with("layers.0.ffn.experts.")));
        for k in [Kind::Qwen3Moe, Kind::GptOss] {
            assert!(spec(k).unwrap().dims(plan::Preset::Release, None).is_err());
        }
    }

    /// gpt-oss's fused experts, written and read back: every canonical tensor the plan has (per
    /// expert `w13`, `w2`, their biases and block scales) is one the reader finds in the release's
    /// fused tensors, and nothing else is there.
    #[test]
    fn gpt_oss_fused_experts_read_back_per_expert() {
        use crate::synth::{synth_to_memory, SynthOptions};
        let g = spec(Kind::GptOss).unwrap();
        let d = g.dims(plan::Preset::Tiny, Some(2)).unwrap();
        for (format, leaves) in [
            (Format::Bf16, &["weight"][..]),
            (Format::Mxfp4, &["weight", "weight_scale"][..]),
            (
                Format::ModelOptNvfp4,
                &["weight", "weight_scale", "weight_scale_2", "input_scale"][..],
            ),
        ] {
            let mut o = SynthOptions::family(Kind::GptOss, format, 1);
            o.layers = Some(2);
            let ck = synth_to_memory(&o).unwrap();
            let mut want: Vec<String> = g
                .blocks(&d, format)
                .iter()
                .flat_map(|b| b.params.iter().map(|p| p.name.clone()))
                .collect();
            for l in plan::all_linears(&g.blocks(&d, format)) {
                // ModelOpt quantizes the attention too (not the router)
                let quantized = l.base.contains(".ffn.experts.")
                    || (format == Format::ModelOptNvfp4 && l.base.contains(".attn."));
                for leaf in leaves {
                    if *leaf == "weight" || quantized {
                        want.push(format!("{}.{leaf}", l.base));
                    }
                }
            }
            want.sort();
            let mut got = ck.canonical_names();
            got.sort();
            assert_eq!(got, want, "{format:?}");
            let raw = ck.tensor_names();
            assert!(raw.contains(&"model.layers.1.mlp.experts.gate_up_proj_bias".to_string()));
        }
    }

    /// ModelOpt's gpt-oss layout read back: each expert's weight equals the same expert encoded
    /// alone (the per-expert NVFP4 of `synth` with the projection's shared tensor scale), so the
    /// transposed bytes and block scales come back in [out, in] order, and the scalars are shared.
    #[test]
    fn gpt_oss_modelopt_experts_equal_their_unfused_encoding() {
        use crate::numerics::e2m1;
        use crate::synth::{synth_to_memory, SynthOptions};
        let mut o = SynthOptions::family(Kind::GptOss, Format::ModelOptNvfp4, 3);
        o.layers = Some(2);
        let ck = synth_to_memory(&o).unwrap();
        let gs = |e: usize, leaf: &str| {
            ck.tensor_f32(&format!("layers.1.ffn.experts.{e}.w13.{leaf}"))
                .unwrap()
                .data[0]
        };
        for e in 1..8 {
            assert_eq!(gs(e, "weight_scale_2"), gs(0, "weight_scale_2"));
            assert_eq!(gs(e, "input_scale"), gs(0, "input_scale"));
        }
        let d = spec(Kind::GptOss)
            .unwrap()
            .dims(plan::Preset::Tiny, Some(2))
            .unwrap();
        let (rows, cols) = (2 * d.inter, d.hidden);
        for e in [0, 5] {
            let base = format!("layers.1.ffn.experts.{e}.w13");
            let w = ck.weight(&base).unwrap();
            assert_eq!(w.scheme(), "nvfp4-modelopt");
            assert_eq!((w.out_features, w.in_features), (rows, cols));
            assert_eq!(
                ck.raw_label(&format!("{base}.weight")).unwrap(),
                format!("model.layers.1.mlp.experts.gate_up_proj[{e}]ᵀ")
            );
            // the reference: the stored [in/2, out] bytes and [in/16, out] scales read by hand
            let packed = ck.bytes("model.layers.1.mlp.experts.gate_up_proj").unwrap();
            let scales = ck
                .bytes("model.layers.1.mlp.experts.gate_up_proj_weight_scale")
                .unwrap();
            let (pe, se) = (cols / 2 * rows, cols / 16 * rows);
            let got = w.dequantize().unwrap().data;
            for r in 0..rows {
                for c in 0..cols {
                    let byte = packed[e * pe + (c / 2) * rows + r];
                    let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
                    let s = crate::numerics::e4m3::decode(scales[e * se + (c / 16) * rows + r]);
                    let want = e2m1::decode(code) * (s * gs(e, "weight_scale_2"));
                    assert_eq!(got[r * cols + c], want, "expert {e} [{r}, {c}]");
                }
            }
        }
    }

    #[test]
    fn schemes_follow_the_releases() {
        let v = spec(Kind::DeepseekV3).unwrap();
        let s = |f, b| v.scheme(f, b);
        assert_eq!(
            s(Format::ModelOptNvfp4, "layers.1.attn.wq_a"),
            WScheme::Bf16
        );
        assert_eq!(
            s(Format::ModelOptNvfp4, "layers.0.ffn.down_proj"),
            WScheme::Nvfp4ModelOpt
        );
        assert_eq!(
            s(Format::Fp8Block, "layers.1.attn.kv_b_proj"),
            WScheme::Fp8F32
        );
        assert_eq!(s(Format::Fp8Block, "layers.1.ffn.gate"), WScheme::Bf16);
        assert_eq!(s(Format::CtNvfp4, "head"), WScheme::Bf16);
        let q = spec(Kind::Qwen3Moe).unwrap();
        assert_eq!(
            q.scheme(Format::CtNvfp4, "layers.0.attn.k_proj"),
            WScheme::Nvfp4Ct
        );
        assert!(parse("gpt-oss").is_ok() && parse("qwen3-moe").is_ok() && parse("gpt").is_err());
        let g = spec(Kind::GptOss).unwrap();
        assert_eq!(
            g.scheme(Format::Mxfp4, "layers.1.ffn.experts.3.w13"),
            WScheme::Mxfp4
        );
        for b in ["layers.1.attn.q_proj", "layers.1.ffn.gate", "head"] {
            assert_eq!(g.scheme(Format::Mxfp4, b), WScheme::Bf16, "{b}");
        }
        assert_eq!(
            g.raw_name("layers.0.ffn.gate.bias"),
            "model.layers.0.mlp.router.bias"
        );
    }
}
