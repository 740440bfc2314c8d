//! The weight-format table (ggml's `type_traits` habit): one [`FormatSpec`] per stored weight
//! format, in one module per format, and every other module looks a format up here instead of
//! matching on its own enum of formats.
//!
//! A spec says, as data: the tensors a weight of the format is made of ([`Tensors`]), how its
//! values decode ([`Decode`]: element code, block-scale code, block shape, tensor scale; the
//! CUDA backend interprets this with one generic kernel, the host with [`decode_blocked`]), how
//! the served path computes with it ([`Served`]), what its lint rules need ([`Lint`]), which
//! quantization configs declare it ([`ConfigClaims`]), its tolerance rows' key, and (for formats
//! read and written entirely through the table) its reference dequantization and synth encoder.
//!
//! Formats whose reading predates the table (dense, FP8 block, MXFP4, NVFP4) keep their own
//! readers in `quant.rs` and their encoders in `synth`, with their facts declared here; a format
//! marked [`Tensors::generic`] (MXFP8) is detected, read, dequantized, served, linted and
//! synthesized from its spec alone.

pub mod dense;
pub mod fp8_block;
pub mod mxfp4;
pub mod mxfp8;
pub mod nvfp4;

use serde::Serialize;
use serde_json::Value;

use super::Dtype;
use crate::numerics::{e2m1, e4m3, ue8m0};

/// The stored format of one linear weight; its facts are [`Scheme::spec`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
pub enum Scheme {
    Dense,
    Fp8Block,
    Mxfp4,
    Nvfp4Ct,
    Nvfp4ModelOpt,
    Mxfp8,
}

/// Every format, in the order detection and the config lint try them (the NVFP4 conventions
/// before MXFP4 before FP8: the order the tolerance table calls coarsest first).
pub static TABLE: &[&FormatSpec] = &[
    &dense::SPEC,
    &nvfp4::CT,
    &nvfp4::MODELOPT,
    &mxfp4::SPEC,
    &fp8_block::SPEC,
    &mxfp8::SPEC,
];

impl Scheme {
    /// The format's entry in [`TABLE`].
    pub fn spec(self) -> &'static FormatSpec {
        TABLE
            .iter()
            .find(|s| s.scheme == self)
            .copied()
            .expect("every scheme has a table entry (tested)")
    }

    /// Stable scheme label. Dense weights are labelled by dtype: "bf16", "f16" or "f32".
    pub fn label(self, weight_dtype: Dtype) -> &'static str {
        if self == Scheme::Dense {
            return match weight_dtype {
                Dtype::F16 => "f16",
                Dtype::F32 => "f32",
                _ => "bf16",
            };
        }
        self.spec().label
    }

    /// The quantized scheme whose label is `label` (None for dense labels and unknown ones).
    pub fn from_label(label: &str) -> Option<Scheme> {
        TABLE
            .iter()
            .find(|s| s.scheme != Scheme::Dense && s.label == label)
            .map(|s| s.scheme)
    }
}

/// One weight format's facts.
pub struct FormatSpec {
    pub scheme: Scheme,
    /// Scheme label in reports, `inspect` and lint ("nvfp4-ct", "mxfp8", …).
    pub label: &'static str,
    /// Name in prose and error messages ("NVFP4", "MXFP8").
    pub name: &'static str,
    /// Family name of the format regardless of producer convention ("nvfp4" for both).
    pub family: &'static str,
    /// Key of its rows in the isolated tolerance table (`probes/isolated-tolerances.toml`);
    /// None for unquantized weights.
    pub tolerance_key: Option<&'static str>,
    pub tensors: Tensors,
    /// How the values decode; None for dense weights (widened as they are).
    pub decode: Option<Decode>,
    pub served: Served,
    pub lint: Lint,
    pub config: ConfigClaims,
    /// The `synth --format` checkpoint of this format (generic formats only).
    pub synth: Option<Synth>,
}

/// The tensors of one weight, as leaves of the weight's module name.
pub struct Tensors {
    /// Leaf of the data tensor.
    pub weight_leaf: &'static str,
    pub weight_dtypes: &'static [Dtype],
    /// Leaves the block scale may have, tried in order.
    pub scale_leaves: &'static [&'static str],
    pub scale_dtypes: &'static [Dtype],
    /// Leaf of the weight's tensor scale (NVFP4).
    pub global_leaf: Option<&'static str>,
    /// Leaf of the static activation scale (NVFP4).
    pub input_leaf: Option<&'static str>,
    /// Read entirely through this table (`WeightFormat::Blocked`); false: `quant.rs` has the
    /// format's own reader.
    pub generic: bool,
    /// How a release stores the format's routed experts fused, one tensor per projection for all
    /// experts (`checkpoint::naming` maps them to per-expert weights); None: only per weight.
    pub fused_experts: Option<FusedExperts>,
}

/// The suffixes of a format's fused expert tensors (gpt-oss's MXFP4: `gate_up_proj_blocks`
/// [E, out, in/32, 16] and `gate_up_proj_scales` [E, out, in/32]): expert e's slice of the first
/// is its weight's data tensor (`weight_leaf`, the trailing dims flattened), of the second its
/// block scale (the first of `scale_leaves`). ModelOpt's NVFP4 export of gpt-oss keeps the
/// fused weight's own name and [E, in, out] orientation (`gate_up_proj` U8 [E, in/2, out],
/// `gate_up_proj_weight_scale` [E, in/16, out]: `transposed`) and stores the tensor scales once
/// per projection under underscore keys (`gate_up_proj_weight_scale_2`, `_input_scale`: a
/// scalar shared by every expert, or one per expert).
pub struct FusedExperts {
    pub data_suffix: &'static str,
    pub scale_suffix: &'static str,
    /// Suffixes of the weight's tensor scale and static activation scale (NVFP4).
    pub global_suffix: Option<&'static str>,
    pub input_suffix: Option<&'static str>,
    /// Each expert's data and block scale stored [in, out] (bytes transposed per expert).
    pub transposed: bool,
}

/// Element code of a block-scaled format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Elem {
    /// E2M1, two per byte, the even element in the low nibble.
    E2m1Packed,
    /// E4M3FN, one per byte.
    E4m3,
}

impl Elem {
    /// Largest finite element magnitude.
    pub fn max(self) -> f32 {
        match self {
            Elem::E2m1Packed => 6.0,
            Elem::E4m3 => e4m3::MAX,
        }
    }
    /// Elements per stored byte.
    pub fn per_byte(self) -> usize {
        match self {
            Elem::E2m1Packed => 2,
            Elem::E4m3 => 1,
        }
    }
    /// The value of element `i` of a row-major code array.
    pub fn value(self, codes: &[u8], i: usize) -> f32 {
        match self {
            Elem::E2m1Packed => {
                let (lo, hi) = e2m1::unpack(codes[i / 2]);
                e2m1::decode(if i.is_multiple_of(2) { lo } else { hi })
            }
            Elem::E4m3 => e4m3::decode(codes[i]),
        }
    }
    /// Whether a stored byte holds a non-zero magnitude, counted per element.
    pub fn nonzero_in(self, b: u8) -> usize {
        match self {
            Elem::E2m1Packed => (b & 0x07 != 0) as usize + (b & 0x70 != 0) as usize,
            Elem::E4m3 => (b & 0x7F != 0) as usize,
        }
    }
}

/// Block-scale code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ScaleCode {
    E4m3,
    Ue8m0,
    /// f32 multipliers (FP8 block: UE8M0 bytes are widened on the host before the device sees them).
    F32,
}

impl ScaleCode {
    /// Name in lint evidence ("E4M3", "UE8M0", "F32").
    pub fn name(self) -> &'static str {
        match self {
            ScaleCode::E4m3 => "E4M3",
            ScaleCode::Ue8m0 => "UE8M0",
            ScaleCode::F32 => "F32",
        }
    }
    /// Decode a scale byte (byte codes only; F32 scales are not bytes).
    pub fn decode(self, b: u8) -> f32 {
        match self {
            ScaleCode::E4m3 => e4m3::decode(b),
            _ => ue8m0::decode(b),
        }
    }
    /// The byte a NaN scale is stored as.
    pub fn nan_byte(self) -> u8 {
        match self {
            ScaleCode::E4m3 => e4m3::NAN_BYTE,
            _ => 0xFF,
        }
    }
}

/// Which elements share one block scale.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Block {
    /// `n` contiguous elements of a row (along the input dimension): scales [out, in/n].
    Row(usize),
    /// A 2-D tile whose size the quantization config gives (FP8 `weight_block_size`).
    Grid,
}

/// How the tensor scale enters the block multiplier.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Global {
    None,
    /// q = s / g (compressed-tensors NVFP4).
    Divide,
    /// q = s · g (ModelOpt NVFP4).
    Multiply,
}

/// A format's device decode as data: value = elem · (scale ∘ global), in f32, one rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Decode {
    pub elem: Elem,
    pub scale: ScaleCode,
    pub block: Block,
    pub global: Global,
}

/// How the served path computes with a weight of the format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Served {
    /// BF16 GEMM, f32 output.
    Dense,
    /// Exact dequantized weight, DeepSeek's FP8 1×128 activation quantization, BF16 output.
    Fp8Act,
    /// The NVFP4 recipes of `served::Profile`.
    Nvfp4,
}

/// What the lint rules need to know about a format.
pub struct Lint {
    pub amax: AmaxRule,
}

/// What the largest block scale says about the weight's amax (rule `scale.convention`).
pub enum AmaxRule {
    /// Judged with the tensor scale (NVFP4's convention checks).
    TensorScale,
    /// amax = max block scale × the largest element; `inverted`: also say what the scales
    /// imply read as divisors; `fix`: the advice.
    BlockMax { inverted: bool, fix: &'static str },
}

/// Which quantization configs declare the format.
pub struct ConfigClaims {
    /// A substring of a compressed-tensors `format`.
    pub ct_format: Option<&'static str>,
    /// A ModelOpt `quant_algo`.
    pub modelopt_algo: Option<&'static str>,
    /// Allowed under a DeepSeek-style `quant_method: fp8` config.
    pub in_fp8: InFp8,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InFp8 {
    Always,
    /// Only as routed experts under `moe_quant_algo: NVFP4`.
    MoeNvfp4Experts,
    /// Only as routed experts under `expert_dtype: fp4`.
    Fp4Experts,
    Never,
}

/// One stored tensor of an encoded weight.
pub struct Stored {
    pub leaf: &'static str,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A format's synthetic checkpoint: its linears encoded with `encode`, the config `config`
/// writes for the excluded (unquantized) modules.
pub struct Synth {
    /// `synth --format` name.
    pub format_name: &'static str,
    /// (weight [out, in] f32, out, in) → its tensors.
    pub encode: fn(&[f32], usize, usize) -> Vec<Stored>,
    /// (raw names of the unquantized modules) → (`quantization_config`, `hf_quant_config.json`).
    pub config: fn(&[String]) -> (Value, Option<Value>),
}

/// The reference dequantization of a block-scaled weight stored as byte codes and byte scales
/// in [`Block::Row`] blocks without a tensor scale: `elem · scale` in f32, row-major [rows, cols].
pub fn decode_blocked(
    d: &Decode,
    codes: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
) -> Vec<f32> {
    let Block::Row(bn) = d.block else {
        unreachable!("generic formats have row blocks (checked by the table test)")
    };
    let nb = cols / bn;
    let mut out = vec![0f32; rows * cols];
    for (i, v) in out.iter_mut().enumerate() {
        let (r, c) = (i / cols, i % cols);
        *v = d.elem.value(codes, i) * d.scale.decode(scales[r * nb + c / bn]);
    }
    out
}

/// The table's generic formats whose data tensor is `leaf` with `dtype`.
pub fn generic_candidates(
    leaf: &str,
    dtype: Dtype,
) -> impl Iterator<Item = &'static FormatSpec> + '_ {
    TABLE.iter().copied().filter(move |s| {
        s.tensors.generic
            && s.tensors.weight_leaf == leaf
            && s.tensors.weight_dtypes.contains(&dtype)
    })
}

/// The generic format with this `synth --format` name.
pub fn synth_format(name: &str) -> Option<&'static FormatSpec> {
    TABLE
        .iter()
        .copied()
        .find(|s| s.synth.as_ref().is_some_and(|y| y.format_name == name))
}

/// Tolerance keys in the table's order (coarsest first), each once.
pub fn tolerance_keys() -> Vec<&'static str> {
    let mut v: Vec<&'static str> = Vec::new();
    for k in TABLE.iter().filter_map(|s| s.tolerance_key) {
        if !v.contains(&k) {
            v.push(k);
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_has_one_entry_and_generic_ones_are_complete() {
        for s in [
            Scheme::Dense,
            Scheme::Fp8Block,
            Scheme::Mxfp4,
            Scheme::Nvfp4Ct,
            Scheme::Nvfp4ModelOpt,
            Scheme::Mxfp8,
        ] {
            assert_eq!(TABLE.iter().filter(|x| x.scheme == s).count(), 1, "{s:?}");
            assert_eq!(s.spec().scheme, s);
        }
        for s in TABLE.iter().filter(|s| s.tensors.generic) {
            let d = s.decode.expect("a generic format decodes");
            assert!(matches!(d.block, Block::Row(n) if n > 0), "{}", s.label);
            assert_eq!(d.global, Global::None, "{}", s.label);
            assert_ne!(d.scale, ScaleCode::F32, "{}", s.label);
            assert_eq!(s.served, Served::Fp8Act, "{}", s.label);
            assert!(!s.tensors.scale_leaves.is_empty());
        }
        assert_eq!(tolerance_keys(), ["nvfp4", "mxfp4", "fp8-block"]);
        assert_eq!(Scheme::from_label("mxfp8"), Some(Scheme::Mxfp8));
        assert_eq!(Scheme::from_label("bf16"), None);
    }
}
