//! MXFP4 (OCP MX): packed E2M1 elements, one UE8M0 scale per 32 elements of a row; `.scale`
//! with I8 codes (official V4), `weight_scale` with U8 codes (compressed-tensors), or gpt-oss's
//! fused experts `*_blocks` / `*_scales` (U8, one slice per expert). Read by
//! `quant.rs`; dequantization `numerics::mxfp4`; encoder in `synth::encode`.

use super::*;

pub static SPEC: FormatSpec = FormatSpec {
    scheme: Scheme::Mxfp4,
    label: "mxfp4",
    name: "MXFP4",
    family: "mxfp4",
    tolerance_key: Some("mxfp4"),
    tensors: Tensors {
        weight_leaf: "weight",
        weight_dtypes: &[Dtype::U8, Dtype::I8],
        scale_leaves: &["weight_scale", "scale"],
        scale_dtypes: &[Dtype::F8_E8M0, Dtype::U8],
        global_leaf: None,
        input_leaf: None,
        generic: false,
        // the gpt-oss releases (openai/gpt-oss-20b, -120b)
        fused_experts: Some(FusedExperts {
            data_suffix: "_blocks",
            scale_suffix: "_scales",
            global_suffix: None,
            input_suffix: None,
            transposed: false,
        }),
    },
    decode: Some(Decode {
        elem: Elem::E2m1Packed,
        scale: ScaleCode::Ue8m0,
        block: Block::Row(crate::numerics::mxfp4::BLOCK),
        global: Global::None,
    }),
    served: Served::Fp8Act,
    lint: Lint {
        amax: AmaxRule::BlockMax {
            inverted: false,
            fix: "Check the exponent bias (127) of the MXFP4 scales (docs/NVFP4.md §6.2).",
        },
    },
    config: ConfigClaims {
        ct_format: Some("mxfp4"),
        modelopt_algo: None,
        in_fp8: InFp8::Fp4Experts,
    },
    synth: None,
};
