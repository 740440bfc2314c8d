//! FP8 block (DeepSeek-V3/V4): E4M3 elements, one scale per 2-D tile whose size
//! `quantization_config.weight_block_size` gives (128×128 by default), stored as f32
//! `weight_scale_inv` or UE8M0 `.scale` (official V4). Read by `quant.rs` (the tile comes from the
//! config); dequantization `numerics::fp8_block`; encoder in `synth::encode`.

use super::*;

pub static SPEC: FormatSpec = FormatSpec {
    scheme: Scheme::Fp8Block,
    label: "fp8-block",
    name: "FP8 block",
    family: "fp8-block",
    tolerance_key: Some("fp8-block"),
    tensors: Tensors {
        weight_leaf: "weight",
        weight_dtypes: &[Dtype::F8_E4M3],
        scale_leaves: &["scale", "weight_scale_inv"],
        scale_dtypes: &[Dtype::F8_E8M0, Dtype::U8, Dtype::F32, Dtype::BF16],
        global_leaf: None,
        input_leaf: None,
        generic: false,
        fused_experts: None,
    },
    // UE8M0 scale bytes are widened to f32 multipliers on the host.
    decode: Some(Decode {
        elem: Elem::E4m3,
        scale: ScaleCode::F32,
        block: Block::Grid,
        global: Global::None,
    }),
    served: Served::Fp8Act,
    lint: Lint {
        amax: AmaxRule::BlockMax {
            inverted: true,
            fix: "FP8 block scales are dequant multipliers s = amax_block/448 (`weight_scale_inv` despite its name, docs/NVFP4.md §6.1); store them that way.",
        },
    },
    config: ConfigClaims {
        ct_format: None,
        modelopt_algo: None,
        in_fp8: InFp8::Always,
    },
    synth: None,
};
