//! NVFP4: packed E2M1 elements, one E4M3 scale per 16 elements of a row, an f32 tensor scale
//! and a static activation scale, in the two producers' conventions (docs/NVFP4.md §3.4):
//! compressed-tensors (`weight_packed`, g = 2688/amax divides) and ModelOpt (`weight`,
//! d = amax/2688 multiplies). Read by `quant.rs`; dequantization `numerics::nvfp4`; the served
//! recipes are `served::Profile`'s; encoder in `synth::encode`.

use super::*;

const DECODE_CT: Decode = Decode {
    elem: Elem::E2m1Packed,
    scale: ScaleCode::E4m3,
    block: Block::Row(crate::numerics::nvfp4::BLOCK),
    global: Global::Divide,
};

pub static CT: FormatSpec = FormatSpec {
    scheme: Scheme::Nvfp4Ct,
    label: "nvfp4-ct",
    name: "NVFP4",
    family: "nvfp4",
    tolerance_key: Some("nvfp4"),
    tensors: Tensors {
        weight_leaf: "weight_packed",
        weight_dtypes: &[Dtype::U8, Dtype::I8],
        scale_leaves: &["weight_scale"],
        scale_dtypes: &[Dtype::F8_E4M3],
        global_leaf: Some("weight_global_scale"),
        input_leaf: Some("input_global_scale"),
        generic: false,
        fused_experts: None,
    },
    decode: Some(DECODE_CT),
    served: Served::Nvfp4,
    lint: Lint {
        amax: AmaxRule::TensorScale,
    },
    config: ConfigClaims {
        ct_format: Some("nvfp4"),
        modelopt_algo: None,
        in_fp8: InFp8::Never,
    },
    synth: None,
};

pub static MODELOPT: FormatSpec = FormatSpec {
    scheme: Scheme::Nvfp4ModelOpt,
    label: "nvfp4-modelopt",
    name: "NVFP4",
    family: "nvfp4",
    tolerance_key: Some("nvfp4"),
    tensors: Tensors {
        weight_leaf: "weight",
        weight_dtypes: &[Dtype::U8, Dtype::I8],
        scale_leaves: &["weight_scale"],
        scale_dtypes: &[Dtype::F8_E4M3],
        global_leaf: Some("weight_scale_2"),
        input_leaf: Some("input_scale"),
        generic: false,
        // ModelOpt's export of gpt-oss's fused experts (vLLM #46641)
        fused_experts: Some(FusedExperts {
            data_suffix: "",
            scale_suffix: "_weight_scale",
            global_suffix: Some("_weight_scale_2"),
            input_suffix: Some("_input_scale"),
            transposed: true,
        }),
    },
    decode: Some(Decode {
        global: Global::Multiply,
        ..DECODE_CT
    }),
    served: Served::Nvfp4,
    lint: Lint {
        amax: AmaxRule::TensorScale,
    },
    config: ConfigClaims {
        ct_format: None,
        modelopt_algo: Some("NVFP4"),
        in_fp8: InFp8::MoeNvfp4Experts,
    },
    synth: None,
};
