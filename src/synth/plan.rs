//! What a synthetic checkpoint contains: preset dimensions, the canonical tensor list, which
//! storage scheme each linear gets in each format, the raw names of both namings, and the
//! config files. Kept free of numbers so the same plan drives the in-memory (tiny) and the
//! streaming (flash-layer) writers.

use serde_json::{json, Value};

use crate::checkpoint::formats::{self, Scheme};
use crate::checkpoint::Naming;
use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Preset {
    Tiny,
    FlashLayer,
    /// A model family's released dimensions (`synth --family deepseek-v3 --preset release`).
    Release,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    Bf16,
    CtNvfp4,
    ModelOptNvfp4,
    OfficialMixed,
    Mxfp4,
    /// DeepSeek's FP8 block release of V3/R1: every linear but the router and the head in
    /// E4M3 with one f32 scale per 128×128 tile (`weight_scale_inv` = amax/448). A family
    /// format (`synth --family deepseek-v3`), not one of V4's.
    Fp8Block,
}

/// What `synth --format` writes: a built-in [`Format`] (a mixture of schemes by role) or a
/// format of the format table with a synth encoder (`formats::Synth`), in which the linears the
/// NVFP4 exports quantize are stored, the rest BF16.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Choice {
    Builtin(Format),
    Table(Scheme),
}

impl From<Format> for Choice {
    fn from(f: Format) -> Choice {
        Choice::Builtin(f)
    }
}

impl Choice {
    /// Every format `synth --format` knows: [`Format::ALL`], then the format table's.
    pub fn known() -> Vec<Choice> {
        let mut v: Vec<Choice> = Format::ALL
            .iter()
            .chain(&Format::FAMILY_ONLY)
            .map(|&f| Choice::Builtin(f))
            .collect();
        v.extend(
            formats::TABLE
                .iter()
                .filter(|s| s.synth.is_some())
                .map(|s| Choice::Table(s.scheme)),
        );
        v
    }
    pub fn parse(s: &str) -> Result<Choice> {
        let known = Choice::known();
        known
            .iter()
            .copied()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                let names: Vec<&str> = known.iter().map(|f| f.name()).collect();
                Error::usage(format!(
                    "unknown format `{s}` (known: {})",
                    names.join(", ")
                ))
            })
    }
    pub fn name(self) -> &'static str {
        match self {
            Choice::Builtin(f) => f.name(),
            Choice::Table(s) => s
                .spec()
                .synth
                .as_ref()
                .map_or(s.spec().label, |y| y.format_name),
        }
    }
    /// Whether any linear carries a static activation scale (needs calibration).
    pub fn has_act_scales(self) -> bool {
        matches!(self, Choice::Builtin(f) if f.has_act_scales())
    }
}

impl Preset {
    pub fn parse(s: &str) -> Result<Preset> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "flash-layer" => Ok(Preset::FlashLayer),
            "release" => Ok(Preset::Release),
            _ => Err(Error::usage(format!(
                "unknown preset `{s}` (known: tiny, flash-layer, release)"
            ))),
        }
    }
}

impl Format {
    pub const ALL: [Format; 5] = [
        Format::Bf16,
        Format::CtNvfp4,
        Format::ModelOptNvfp4,
        Format::OfficialMixed,
        Format::Mxfp4,
    ];
    /// Formats only a model family ships (`synth::family`), refused for V4.
    pub const FAMILY_ONLY: [Format; 1] = [Format::Fp8Block];
    pub fn parse(s: &str) -> Result<Format> {
        Format::ALL
            .into_iter()
            .find(|f| f.name() == s)
            .ok_or_else(|| {
                Error::usage(format!(
                    "unknown format `{s}` (known: bf16, ct-nvfp4, modelopt-nvfp4, official-mixed, mxfp4)"
                ))
            })
    }
    pub fn name(self) -> &'static str {
        match self {
            Format::Bf16 => "bf16",
            Format::CtNvfp4 => "ct-nvfp4",
            Format::ModelOptNvfp4 => "modelopt-nvfp4",
            Format::OfficialMixed => "official-mixed",
            Format::Mxfp4 => "mxfp4",
            Format::Fp8Block => "fp8-block",
        }
    }
    /// Whether any linear of this format carries a static activation scale (needs calibration).
    pub fn has_act_scales(self) -> bool {
        matches!(
            self,
            Format::CtNvfp4 | Format::ModelOptNvfp4 | Format::OfficialMixed
        )
    }
}

pub fn parse_naming(s: &str) -> Result<Naming> {
    match s {
        "official" => Ok(Naming::Official),
        "hf" => Ok(Naming::Hf),
        _ => Err(Error::usage(format!(
            "unknown naming `{s}` (known: official, hf)"
        ))),
    }
}

/// How one linear weight is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WScheme {
    Bf16,
    Nvfp4Ct,
    Nvfp4ModelOpt,
    /// Block FP8 128×128 with power-of-two (UE8M0) scales.
    Fp8,
    /// Block FP8 128×128 with f32 scales amax/448, not rounded to powers of two (DeepSeek-V3's
    /// release, `weight_scale_inv`).
    Fp8F32,
    Mxfp4,
    /// A format of the format table, encoded by its spec's encoder.
    Table(Scheme),
}

impl WScheme {
    pub fn name(self) -> &'static str {
        match self {
            WScheme::Bf16 => "bf16",
            WScheme::Nvfp4Ct => "nvfp4-ct",
            WScheme::Nvfp4ModelOpt => "nvfp4-modelopt",
            WScheme::Fp8 | WScheme::Fp8F32 => "fp8-block",
            WScheme::Mxfp4 => "mxfp4",
            WScheme::Table(s) => s.spec().label,
        }
    }
    pub fn is_nvfp4(self) -> bool {
        matches!(self, WScheme::Nvfp4Ct | WScheme::Nvfp4ModelOpt)
    }
}

/// Role of a linear inside a layer, from its canonical base.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    QA,
    Kv,
    QB,
    WoA,
    WoB,
    Compressor,
    IndexerWqB,
    IndexerOther,
    Router,
    Shared(u8),
    Expert(u8),
    Head,
    /// An input-side attention projection of a model family (`attn.q_proj`, `k_proj`, `v_proj`,
    /// `kv_a_proj_with_mqa`, `kv_b_proj`); the families' `o_proj` is [`Role::WoB`] (the block's
    /// output), their dense MLP (`ffn.gate_proj`/`up_proj`/`down_proj`) [`Role::Shared`] (an
    /// always-on MLP like the shared expert).
    FamilyAttn,
}

pub fn role(base: &str) -> Role {
    let rest = match base.strip_prefix("layers.") {
        Some(r) => r.split_once('.').map(|x| x.1).unwrap_or(r),
        None => return Role::Head,
    };
    let proj = |s: &str| match s.rsplit('.').next() {
        Some("w1") => 1,
        Some("w2") => 2,
        _ => 3,
    };
    match rest {
        "attn.wq_a" => Role::QA,
        "attn.wkv" => Role::Kv,
        "attn.wq_b" => Role::QB,
        "attn.wo_a" => Role::WoA,
        "attn.wo_b" => Role::WoB,
        "attn.indexer.wq_b" => Role::IndexerWqB,
        "ffn.gate" => Role::Router,
        "attn.o_proj" => Role::WoB,
        "attn.q_proj"
        | "attn.k_proj"
        | "attn.v_proj"
        | "attn.kv_a_proj_with_mqa"
        | "attn.kv_b_proj" => Role::FamilyAttn,
        "ffn.gate_proj" => Role::Shared(1),
        "ffn.up_proj" => Role::Shared(3),
        "ffn.down_proj" => Role::Shared(2),
        r if r.starts_with("attn.compressor.") => Role::Compressor,
        r if r.starts_with("attn.indexer.") => Role::IndexerOther,
        r if r.starts_with("ffn.shared_experts.") => Role::Shared(proj(r)),
        r => Role::Expert(proj(r)),
    }
}

/// The scheme of a linear in a format (docs/DSV4-LAYER.md §2.1 for the official/NVIDIA releases;
/// the NVFP4 exports quantise attention q_a/kv/q_b/wo_b and all experts, leaving wo_a, router,
/// compressor and indexer BF16 like FORK's README describes).
pub fn scheme(format: impl Into<Choice>, base: &str) -> WScheme {
    let r = role(base);
    let format = match format.into() {
        Choice::Builtin(f) => f,
        Choice::Table(s) => {
            return match r {
                Role::QA | Role::Kv | Role::QB | Role::WoB | Role::Shared(_) | Role::Expert(_) => {
                    WScheme::Table(s)
                }
                _ => WScheme::Bf16,
            }
        }
    };
    match format {
        Format::Bf16 => WScheme::Bf16,
        Format::CtNvfp4 | Format::ModelOptNvfp4 => {
            let nv = if format == Format::CtNvfp4 {
                WScheme::Nvfp4Ct
            } else {
                WScheme::Nvfp4ModelOpt
            };
            match r {
                Role::QA | Role::Kv | Role::QB | Role::WoB | Role::Shared(_) | Role::Expert(_) => {
                    nv
                }
                _ => WScheme::Bf16,
            }
        }
        Format::OfficialMixed | Format::Mxfp4 => match r {
            Role::QA
            | Role::Kv
            | Role::QB
            | Role::WoA
            | Role::WoB
            | Role::IndexerWqB
            | Role::Shared(_) => WScheme::Fp8,
            Role::Expert(_) if format == Format::Mxfp4 => WScheme::Mxfp4,
            Role::Expert(_) => WScheme::Nvfp4ModelOpt,
            _ => WScheme::Bf16,
        },
        // refused for V4 (`synth::Ctx::new`); the families plan their own schemes
        Format::Fp8Block => WScheme::Fp8,
    }
}

/// HCA compress ratio of the tiny preset (see [`Dims::new`]).
pub const TINY_HCA_RATIO: usize = 16;

/// Model dimensions of a preset.
#[derive(Clone, Debug, PartialEq)]
pub struct Dims {
    pub hidden: usize,
    pub layers: usize,
    pub vocab: usize,
    pub heads: usize,
    pub head_dim: usize,
    pub rope_dim: usize,
    pub q_lora: usize,
    pub o_groups: usize,
    pub o_lora: usize,
    pub window: usize,
    /// Compress ratio of the HCA layers (CSA layers are always 4).
    pub hca: usize,
    pub ratios: Vec<usize>,
    pub experts: usize,
    pub topk: usize,
    pub shared: usize,
    pub inter: usize,
    pub hash_layers: usize,
    pub index_heads: usize,
    pub index_dim: usize,
    pub index_topk: usize,
    pub routed_scaling: f64,
    pub hc: usize,
    pub sinkhorn: usize,
}

impl Dims {
    pub fn new(preset: Preset, layers: Option<usize>) -> Result<Dims> {
        let n = layers.unwrap_or(match preset {
            Preset::Tiny => 5,
            Preset::FlashLayer | Preset::Release => 1,
        });
        if n == 0 || n > 64 {
            return Err(Error::usage(format!("--layers {n}: must be in 1..=64")));
        }
        Ok(match preset {
            Preset::Release => {
                return Err(Error::usage(
                    "--preset release is a model family's (--family deepseek-v3); DeepSeek-V4's released layer is --preset flash-layer",
                ))
            }
            // Tiny keeps the real structure (docs/DSV4-LAYER.md §6): sliding, HCA and CSA layers, a
            // hash layer, the grouped output projection, 512-wide heads with 64 rope dims. Its
            // HCA layers compress 16 tokens per row, not 128: the model code takes any ratio
            // ≥ 2 (4 alone means CSA with the overlap compressor and the indexer), and a
            // 64-token prompt then gives 4 compressed rows per HCA layer (with 128 it gives
            // none, and the HCA compressor would never be exercised by a default run).
            Preset::Tiny => Dims {
                hidden: 256,
                layers: n,
                vocab: 512,
                heads: 4,
                head_dim: 512,
                rope_dim: 64,
                q_lora: 256,
                o_groups: 2,
                o_lora: 256,
                window: 128,
                hca: TINY_HCA_RATIO,
                ratios: (0..n)
                    .map(|i| match i {
                        0 => 0,
                        i if i % 2 == 1 => TINY_HCA_RATIO,
                        _ => 4,
                    })
                    .collect(),
                experts: 8,
                topk: 2,
                shared: 1,
                inter: 256,
                hash_layers: 1,
                index_heads: 16,
                index_dim: 128,
                index_topk: 8,
                routed_scaling: 2.5,
                hc: 4,
                sinkhorn: 20,
            },
            // V4-Flash (docs/DSV4-LAYER.md §1): layers 0, 1 window-only, then CSA/HCA alternating.
            Preset::FlashLayer => Dims {
                hidden: 4096,
                layers: n,
                vocab: 129280,
                heads: 64,
                head_dim: 512,
                rope_dim: 64,
                q_lora: 1024,
                o_groups: 8,
                o_lora: 1024,
                window: 128,
                hca: 128,
                ratios: (0..n)
                    .map(|i| match i {
                        0 | 1 => 0,
                        i if i % 2 == 0 => 4,
                        _ => 128,
                    })
                    .collect(),
                experts: 256,
                topk: 6,
                shared: 1,
                inter: 2048,
                hash_layers: 3,
                index_heads: 64,
                index_dim: 128,
                index_topk: 512,
                routed_scaling: 1.5,
                hc: 4,
                sinkhorn: 20,
            },
        })
    }

    pub fn hc_mix(&self) -> usize {
        (2 + self.hc) * self.hc
    }
}

/// dtype class of a non-linear parameter as the official checkpoint stores it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PDtype {
    Bf16,
    F32,
    I64,
}

/// How a non-linear parameter is drawn (see `gen`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PKind {
    Norm,
    Embed,
    HcFn,
    HcBase,
    HcScale,
    Sink,
    Ape,
    Bias,
    Tid2eid,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ParamSpec {
    pub name: String,
    pub shape: Vec<usize>,
    pub dtype: PDtype,
    pub kind: PKind,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LinSpec {
    pub base: String,
    pub out: usize,
    pub inp: usize,
}

/// Linears quantised together: members share one NVFP4 tensor scale (producers link the
/// observers of fused pairs: q_a/kv, w1/w3).
#[derive(Clone, Debug, PartialEq)]
pub struct Group {
    pub members: Vec<LinSpec>,
}

/// Everything of one layer (or of the model level when `layer` is None).
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub layer: Option<usize>,
    pub params: Vec<ParamSpec>,
    /// Attention, router, compressor, indexer and shared-expert groups.
    pub groups: Vec<Group>,
    /// Routed experts: one group (w1, w3) and one (w2) per expert, in expert order.
    pub experts: Vec<[Group; 2]>,
}

pub(super) fn lin(base: String, out: usize, inp: usize) -> LinSpec {
    LinSpec { base, out, inp }
}

pub(super) fn single(base: String, out: usize, inp: usize) -> Group {
    Group {
        members: vec![lin(base, out, inp)],
    }
}

pub(super) fn param(name: String, shape: Vec<usize>, dtype: PDtype, kind: PKind) -> ParamSpec {
    ParamSpec {
        name,
        shape,
        dtype,
        kind,
    }
}

/// The canonical tensor list, model-level block first, then one block per layer.
pub fn blocks(d: &Dims) -> Vec<Block> {
    let mut out = Vec::new();
    let (dd, hc, mix) = (d.hidden, d.hc, d.hc_mix());
    out.push(Block {
        layer: None,
        params: vec![
            param(
                "embed.weight".into(),
                vec![d.vocab, dd],
                PDtype::Bf16,
                PKind::Embed,
            ),
            param("norm.weight".into(), vec![dd], PDtype::Bf16, PKind::Norm),
            param(
                "hc_head_fn".into(),
                vec![hc, hc * dd],
                PDtype::F32,
                PKind::HcFn,
            ),
            param("hc_head_base".into(), vec![hc], PDtype::F32, PKind::HcBase),
            param("hc_head_scale".into(), vec![1], PDtype::F32, PKind::HcScale),
        ],
        groups: vec![single("head".into(), d.vocab, dd)],
        experts: Vec::new(),
    });
    for n in 0..d.layers {
        let p = |s: &str| format!("layers.{n}.{s}");
        let r = d.ratios[n];
        let c = if r == 4 { 2 } else { 1 };
        let mut params = vec![
            param(p("attn_norm.weight"), vec![dd], PDtype::Bf16, PKind::Norm),
            param(p("ffn_norm.weight"), vec![dd], PDtype::Bf16, PKind::Norm),
        ];
        for side in ["attn", "ffn"] {
            params.push(param(
                p(&format!("hc_{side}_fn")),
                vec![mix, hc * dd],
                PDtype::F32,
                PKind::HcFn,
            ));
            params.push(param(
                p(&format!("hc_{side}_base")),
                vec![mix],
                PDtype::F32,
                PKind::HcBase,
            ));
            params.push(param(
                p(&format!("hc_{side}_scale")),
                vec![3],
                PDtype::F32,
                PKind::HcScale,
            ));
        }
        params.push(param(
            p("attn.q_norm.weight"),
            vec![d.q_lora],
            PDtype::Bf16,
            PKind::Norm,
        ));
        params.push(param(
            p("attn.kv_norm.weight"),
            vec![d.head_dim],
            PDtype::Bf16,
            PKind::Norm,
        ));
        params.push(param(
            p("attn.attn_sink"),
            vec![d.heads],
            PDtype::F32,
            PKind::Sink,
        ));
        let hd = d.heads * d.head_dim;
        let mut groups = vec![
            Group {
                members: vec![
                    lin(p("attn.wq_a"), d.q_lora, dd),
                    lin(p("attn.wkv"), d.head_dim, dd),
                ],
            },
            single(p("attn.wq_b"), hd, d.q_lora),
            single(p("attn.wo_a"), d.o_groups * d.o_lora, hd / d.o_groups),
            single(p("attn.wo_b"), dd, d.o_groups * d.o_lora),
        ];
        if r > 0 {
            params.push(param(
                p("attn.compressor.ape"),
                vec![r, c * d.head_dim],
                PDtype::F32,
                PKind::Ape,
            ));
            params.push(param(
                p("attn.compressor.norm.weight"),
                vec![d.head_dim],
                PDtype::Bf16,
                PKind::Norm,
            ));
            groups.push(single(p("attn.compressor.wkv"), c * d.head_dim, dd));
            groups.push(single(p("attn.compressor.wgate"), c * d.head_dim, dd));
        }
        if r == 4 {
            let di = d.index_dim;
            params.push(param(
                p("attn.indexer.compressor.ape"),
                vec![4, 2 * di],
                PDtype::F32,
                PKind::Ape,
            ));
            params.push(param(
                p("attn.indexer.compressor.norm.weight"),
                vec![di],
                PDtype::Bf16,
                PKind::Norm,
            ));
            groups.push(single(p("attn.indexer.wq_b"), d.index_heads * di, d.q_lora));
            groups.push(single(p("attn.indexer.weights_proj"), d.index_heads, dd));
            groups.push(single(p("attn.indexer.compressor.wkv"), 2 * di, dd));
            groups.push(single(p("attn.indexer.compressor.wgate"), 2 * di, dd));
        }
        groups.push(single(p("ffn.gate"), d.experts, dd));
        if n < d.hash_layers {
            params.push(param(
                p("ffn.gate.tid2eid"),
                vec![d.vocab, d.topk],
                PDtype::I64,
                PKind::Tid2eid,
            ));
        } else {
            params.push(param(
                p("ffn.gate.bias"),
                vec![d.experts],
                PDtype::F32,
                PKind::Bias,
            ));
        }
        let si = d.inter * d.shared;
        groups.push(Group {
            members: vec![
                lin(p("ffn.shared_experts.w1"), si, dd),
                lin(p("ffn.shared_experts.w3"), si, dd),
            ],
        });
        groups.push(single(p("ffn.shared_experts.w2"), dd, si));
        let experts = (0..d.experts)
            .map(|e| {
                let q = |w: &str| p(&format!("ffn.experts.{e}.{w}"));
                [
                    Group {
                        members: vec![lin(q("w1"), d.inter, dd), lin(q("w3"), d.inter, dd)],
                    },
                    single(q("w2"), dd, d.inter),
                ]
            })
            .collect();
        out.push(Block {
            layer: Some(n),
            params,
            groups,
            experts,
        });
    }
    out
}

/// Every linear base of the plan, in plan order.
pub fn all_linears(blocks: &[Block]) -> Vec<LinSpec> {
    let mut v = Vec::new();
    for b in blocks {
        for g in &b.groups {
            v.extend(g.members.iter().cloned());
        }
        for e in &b.experts {
            for g in e {
                v.extend(g.members.iter().cloned());
            }
        }
    }
    v
}

// ---------------------------------------------------------------------------------------------
// Raw names.

fn rename<'a>(s: &'a str, table: &[(&str, &'a str)]) -> Option<(&'a str, &'a str)> {
    let (head, rest) = s.split_once('.').unwrap_or((s, ""));
    table
        .iter()
        .find(|(from, _)| *from == head)
        .map(|(_, to)| (*to, rest))
}

fn join(a: &str, b: &str) -> String {
    if b.is_empty() {
        a.to_string()
    } else {
        format!("{a}.{b}")
    }
}

const ATTN: &[(&str, &str)] = &[
    ("wq_a", "q_a_proj"),
    ("wq_b", "q_b_proj"),
    ("wkv", "kv_proj"),
    ("wo_a", "o_a_proj"),
    ("wo_b", "o_b_proj"),
    ("q_norm", "q_a_norm"),
    ("kv_norm", "kv_norm"),
    ("attn_sink", "sinks"),
];
const COMP: &[(&str, &str)] = &[
    ("wkv", "kv_proj"),
    ("wgate", "gate_proj"),
    ("norm", "kv_norm"),
    ("ape", "position_bias"),
];
const MLP: &[(&str, &str)] = &[("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")];

/// Raw checkpoint name of a canonical (official) tensor name in a naming. The HF spelling is
/// transformers' module naming (docs/DSV4-LAYER.md §2.2) with un-fused experts, as a ModelOpt export
/// from transformers writes them.
pub fn raw_name(canonical: &str, naming: Naming) -> String {
    if naming == Naming::Official {
        return canonical.to_string();
    }
    match canonical {
        "embed.weight" => return "model.embed_tokens.weight".into(),
        "norm.weight" => return "model.norm.weight".into(),
        "head.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    if let Some(rest) = canonical.strip_prefix("head.") {
        return format!("lm_head.{rest}");
    }
    if let Some(leaf) = canonical.strip_prefix("hc_head_") {
        return format!("model.hc_head.hc_{leaf}");
    }
    let Some(after) = canonical.strip_prefix("layers.") else {
        return format!("model.{canonical}");
    };
    let Some((n, tail)) = after.split_once('.') else {
        return format!("model.{canonical}");
    };
    let t = match tail {
        "attn_norm.weight" => "input_layernorm.weight".to_string(),
        "ffn_norm.weight" => "post_attention_layernorm.weight".to_string(),
        t if t.starts_with("hc_attn_") => format!("attn_hc.{}", &t["hc_attn_".len()..]),
        t if t.starts_with("hc_ffn_") => format!("ffn_hc.{}", &t["hc_ffn_".len()..]),
        t => {
            if let Some(a) = t.strip_prefix("attn.") {
                if let Some(ic) = a.strip_prefix("indexer.compressor.") {
                    match rename(ic, COMP) {
                        Some((h, r)) => join(&format!("self_attn.compressor.indexer.{h}"), r),
                        None => format!("self_attn.compressor.indexer.{ic}"),
                    }
                } else if let Some(ix) = a.strip_prefix("indexer.") {
                    match rename(
                        ix,
                        &[
                            ("wq_b", "q_b_proj"),
                            ("weights_proj", "scorer.weights_proj"),
                        ],
                    ) {
                        Some((h, r)) => join(&format!("self_attn.compressor.indexer.{h}"), r),
                        None => format!("self_attn.compressor.indexer.{ix}"),
                    }
                } else if let Some(c) = a.strip_prefix("compressor.") {
                    match rename(c, COMP) {
                        Some((h, r)) => join(&format!("self_attn.compressor.{h}"), r),
                        None => format!("self_attn.compressor.{c}"),
                    }
                } else {
                    match rename(a, ATTN) {
                        Some((h, r)) => join(&format!("self_attn.{h}"), r),
                        None => format!("self_attn.{a}"),
                    }
                }
            } else if let Some(f) = t.strip_prefix("ffn.") {
                if let Some(g) = f.strip_prefix("gate.") {
                    let g = if g == "bias" {
                        "e_score_correction_bias"
                    } else {
                        g
                    };
                    format!("mlp.gate.{g}")
                } else if let Some(s) = f.strip_prefix("shared_experts.") {
                    match rename(s, MLP) {
                        Some((h, r)) => join(&format!("mlp.shared_experts.{h}"), r),
                        None => format!("mlp.shared_experts.{s}"),
                    }
                } else if let Some(e) = f.strip_prefix("experts.") {
                    let (ex, rest) = e.split_once('.').unwrap_or((e, ""));
                    match rename(rest, MLP) {
                        Some((h, r)) => join(&format!("mlp.experts.{ex}.{h}"), r),
                        None => format!("mlp.experts.{e}"),
                    }
                } else {
                    format!("mlp.{f}")
                }
            } else {
                t.to_string()
            }
        }
    };
    format!("model.layers.{n}.{t}")
}

/// Raw module name of a linear base (for `ignore` / `exclude_modules` lists).
pub fn raw_module(base: &str, naming: Naming) -> String {
    let w = raw_name(&format!("{base}.weight"), naming);
    w.strip_suffix(".weight").unwrap_or(&w).to_string()
}

// ---------------------------------------------------------------------------------------------
// Config files.

fn model_config(d: &Dims, naming: Naming) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    let mut put = |k: &str, v: Value| {
        m.insert(k.to_string(), v);
    };
    put("architectures", json!(["DeepseekV4ForCausalLM"]));
    put("model_type", json!("deepseek_v4"));
    put("hidden_size", json!(d.hidden));
    put("num_hidden_layers", json!(d.layers));
    put("vocab_size", json!(d.vocab));
    put("num_attention_heads", json!(d.heads));
    put("num_key_value_heads", json!(1));
    put("head_dim", json!(d.head_dim));
    put("qk_rope_head_dim", json!(d.rope_dim));
    put("q_lora_rank", json!(d.q_lora));
    put("o_groups", json!(d.o_groups));
    put("o_lora_rank", json!(d.o_lora));
    put("sliding_window", json!(d.window));
    put("max_position_embeddings", json!(1048576));
    put("rms_norm_eps", json!(1e-6));
    put("hc_mult", json!(d.hc));
    put("hc_sinkhorn_iters", json!(d.sinkhorn));
    put("hc_eps", json!(1e-6));
    put("n_routed_experts", json!(d.experts));
    put("num_experts_per_tok", json!(d.topk));
    put("n_shared_experts", json!(d.shared));
    put("moe_intermediate_size", json!(d.inter));
    put("scoring_func", json!("sqrtsoftplus"));
    put("topk_method", json!("noaux_tc"));
    put("norm_topk_prob", json!(true));
    put("routed_scaling_factor", json!(d.routed_scaling));
    put("swiglu_limit", json!(10.0));
    put("hidden_act", json!("silu"));
    put("index_n_heads", json!(d.index_heads));
    put("index_head_dim", json!(d.index_dim));
    put("index_topk", json!(d.index_topk));
    put("tie_word_embeddings", json!(false));
    put("bos_token_id", json!(0));
    put("eos_token_id", json!(1));
    // No mtp.* tensors are generated, so no MTP block is declared (the official array still
    // carries the MTP entry, see below).
    put("num_nextn_predict_layers", json!(0));
    let yarn = json!({
        "beta_fast": 32, "beta_slow": 1, "factor": 16,
        "original_max_position_embeddings": 65536,
    });
    match naming {
        Naming::Official | Naming::HfHybrid => {
            let mut ratios = d.ratios.clone();
            ratios.push(0);
            put("compress_ratios", json!(ratios));
            put("num_hash_layers", json!(d.hash_layers));
            put("rope_theta", json!(10000.0));
            put("compress_rope_theta", json!(160000.0));
            let mut y = yarn.clone();
            y["type"] = json!("yarn");
            put("rope_scaling", y);
            put("torch_dtype", json!("bfloat16"));
        }
        Naming::Hf => {
            let lt: Vec<&str> = d
                .ratios
                .iter()
                .map(|r| match r {
                    0 => "sliding_attention",
                    4 => "compressed_sparse_attention",
                    _ => "heavily_compressed_attention",
                })
                .collect();
            put("layer_types", json!(lt));
            put(
                "compress_rates",
                json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": d.hca}),
            );
            let ml: Vec<&str> = (0..d.layers)
                .map(|i| if i < d.hash_layers { "hash_moe" } else { "moe" })
                .collect();
            put("mlp_layer_types", json!(ml));
            let prf = d.rope_dim as f64 / d.head_dim as f64;
            put("partial_rotary_factor", json!(prf));
            let mut comp = yarn.clone();
            comp["rope_theta"] = json!(160000.0);
            comp["rope_type"] = json!("yarn");
            comp["type"] = json!("yarn");
            comp["attention_factor"] = json!(1.0);
            comp["partial_rotary_factor"] = json!(prf);
            put(
                "rope_parameters",
                json!({
                    "main": {"rope_theta": 10000.0, "rope_type": "default", "partial_rotary_factor": prf},
                    "compress": comp,
                }),
            );
            put("rope_theta", json!(10000.0));
            put("compress_rope_theta", json!(160000.0));
            put("dtype", json!("bfloat16"));
            put("transformers_version", json!("5.17.0"));
        }
    }
    m
}

/// Modules left unquantised by the NVFP4 part of a format, as raw module names.
fn excluded(format: Choice, blocks: &[Block], naming: Naming, want: WScheme) -> Vec<String> {
    all_linears(blocks)
        .iter()
        .filter(|l| scheme(format, &l.base) != want)
        .map(|l| raw_module(&l.base, naming))
        .collect()
}

/// `config.json` and (ModelOpt formats) `hf_quant_config.json` contents.
pub fn config_files(
    d: &Dims,
    format: impl Into<Choice>,
    naming: Naming,
    blocks: &[Block],
) -> (String, Option<String>) {
    let mut m = model_config(d, naming);
    let mut hq = None;
    let pretty = |v: &Value| serde_json::to_string_pretty(v).unwrap_or_else(|_| "{}".into());
    let choice = format.into();
    let format = match choice {
        Choice::Builtin(f) => f,
        Choice::Table(s) => {
            if let Some(y) = &s.spec().synth {
                let ex = excluded(choice, blocks, naming, WScheme::Table(s));
                let (qc, h) = (y.config)(&ex);
                m.insert("quantization_config".into(), qc);
                hq = h;
            }
            return (pretty(&Value::Object(m)), hq.as_ref().map(pretty));
        }
    };
    let fp8_qc = json!({
        "quant_method": "fp8",
        "fmt": "e4m3",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
        "activation_scheme": "dynamic",
    });
    match format {
        Format::Bf16 => {}
        Format::CtNvfp4 => {
            let args = |dynamic: Value| {
                json!({
                    "num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16,
                    "symmetric": true, "dynamic": dynamic, "observer": "static_minmax",
                    "scale_dtype": "float8_e4m3fn", "zp_dtype": null, "actorder": null,
                    "block_structure": null, "observer_kwargs": {},
                })
            };
            m.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "compressed-tensors",
                    "format": "nvfp4-pack-quantized",
                    "quantization_status": "compressed",
                    "version": "0.20.0",
                    "config_groups": {"group_0": {
                        "targets": ["Linear"],
                        "format": "nvfp4-pack-quantized",
                        "weights": args(json!(false)),
                        "input_activations": args(json!("local")),
                        "output_activations": null,
                    }},
                    "ignore": excluded(choice, blocks, naming, WScheme::Nvfp4Ct),
                    "kv_cache_scheme": null,
                    "global_compression_ratio": null,
                    "sparsity_config": {},
                    "transform_config": {},
                }),
            );
        }
        Format::ModelOptNvfp4 => {
            let ex = excluded(choice, blocks, naming, WScheme::Nvfp4ModelOpt);
            m.insert(
                "quantization_config".into(),
                json!({
                    "quant_method": "modelopt",
                    "quant_algo": "NVFP4",
                    "group_size": 16,
                    "kv_cache_quant_algo": null,
                    "exclude_modules": ex,
                }),
            );
            hq = Some(json!({
                "producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {
                    "quant_algo": "NVFP4",
                    "kv_cache_quant_algo": null,
                    "group_size": 16,
                    "exclude_modules": ex,
                },
            }));
        }
        Format::OfficialMixed => {
            let pat = |s: &str| match naming {
                Naming::Hf => s
                    .replace("*.attn.*", "*.self_attn.*")
                    .replace("*.ffn.shared_experts.*", "*.mlp.shared_experts.*")
                    .replace("head", "lm_head"),
                _ => s.to_string(),
            };
            let ex: Vec<String> = ["*.attn.*", "*.ffn.shared_experts.*", "head", "mtp.*"]
                .iter()
                .map(|s| pat(s))
                .collect();
            let mut qc = fp8_qc.clone();
            qc["quant_algo"] = json!("MIXED_PRECISION");
            qc["moe_quant_algo"] = json!("NVFP4");
            qc["expert_dtype"] = json!("fp4");
            qc["group_size"] = json!(16);
            qc["ignore"] = json!(ex);
            qc["exclude_modules"] = json!(ex);
            m.insert("quantization_config".into(), qc);
            m.insert("expert_dtype".into(), json!("fp4"));
            let mut layers = serde_json::Map::new();
            for l in all_linears(blocks) {
                if scheme(format, &l.base) == WScheme::Nvfp4ModelOpt {
                    layers.insert(
                        raw_module(&l.base, naming),
                        json!({"quant_algo": "NVFP4", "group_size": 16}),
                    );
                }
            }
            hq = Some(json!({
                "producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {
                    "quant_algo": "MIXED_PRECISION",
                    "kv_cache_quant_algo": null,
                    "quantized_layers": layers,
                },
            }));
        }
        Format::Mxfp4 => {
            m.insert("quantization_config".into(), fp8_qc);
            m.insert("expert_dtype".into(), json!("fp4"));
        }
        // refused for V4 (`synth::Ctx::new`)
        Format::Fp8Block => {
            m.insert("quantization_config".into(), fp8_qc);
        }
    }
    (pretty(&Value::Object(m)), hq.as_ref().map(pretty))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::naming::{canonical, Canon};

    /// Every raw name maps back to its canonical through the checkpoint reader's own (separately
    /// written) HF rules.
    #[test]
    fn hf_names_round_trip_through_the_reader() {
        let d = Dims::new(Preset::Tiny, None).unwrap();
        let bl = blocks(&d);
        let mut names: Vec<String> = Vec::new();
        for b in &bl {
            names.extend(b.params.iter().map(|p| p.name.clone()));
        }
        for l in all_linears(&bl) {
            for leaf in [
                "weight",
                "weight_scale",
                "weight_scale_2",
                "input_scale",
                "weight_packed",
                "weight_global_scale",
                "input_global_scale",
                "weight_scale_inv",
            ] {
                names.push(format!("{}.{leaf}", l.base));
            }
        }
        for c in names {
            let raw = raw_name(&c, Naming::Hf);
            assert_eq!(
                canonical(&raw, Naming::Hf),
                Canon::Plain(c.clone()),
                "{raw}"
            );
            assert_eq!(raw_name(&c, Naming::Official), c);
        }
        assert_eq!(
            raw_name("layers.2.attn.indexer.compressor.ape", Naming::Hf),
            "model.layers.2.self_attn.compressor.indexer.position_bias"
        );
        assert_eq!(
            raw_name("layers.0.ffn.experts.3.w2.weight", Naming::Hf),
            "model.layers.0.mlp.experts.3.down_proj.weight"
        );
    }

    #[test]
    fn schemes_per_format() {
        use WScheme::*;
        let cases = [
            (
                "layers.1.attn.wq_a",
                [Bf16, Nvfp4Ct, Nvfp4ModelOpt, Fp8, Fp8],
            ),
            ("layers.1.attn.wo_a", [Bf16, Bf16, Bf16, Fp8, Fp8]),
            ("layers.2.attn.indexer.wq_b", [Bf16, Bf16, Bf16, Fp8, Fp8]),
            ("layers.2.attn.indexer.weights_proj", [Bf16; 5]),
            ("layers.2.attn.compressor.wkv", [Bf16; 5]),
            ("layers.2.ffn.gate", [Bf16; 5]),
            (
                "layers.2.ffn.shared_experts.w2",
                [Bf16, Nvfp4Ct, Nvfp4ModelOpt, Fp8, Fp8],
            ),
            (
                "layers.2.ffn.experts.7.w3",
                [Bf16, Nvfp4Ct, Nvfp4ModelOpt, Nvfp4ModelOpt, Mxfp4],
            ),
            ("head", [Bf16; 5]),
        ];
        for (base, want) in cases {
            for (f, w) in Format::ALL.iter().zip(want) {
                assert_eq!(scheme(*f, base), w, "{base} in {}", f.name());
            }
        }
    }
}
