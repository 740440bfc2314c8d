//! Dense weights (BF16/F16/F32): widened exactly, served as a BF16 GEMM with f32 output.

use super::*;

pub static SPEC: FormatSpec = FormatSpec {
    scheme: Scheme::Dense,
    label: "bf16",
    name: "BF16",
    family: "bf16",
    tolerance_key: None,
    tensors: Tensors {
        weight_leaf: "weight",
        weight_dtypes: &[Dtype::BF16, Dtype::F16, Dtype::F32],
        scale_leaves: &[],
        scale_dtypes: &[],
        global_leaf: None,
        input_leaf: None,
        generic: false,
        fused_experts: None,
    },
    decode: None,
    served: Served::Dense,
    lint: Lint {
        amax: AmaxRule::BlockMax {
            inverted: false,
            fix: "",
        },
    },
    config: ConfigClaims {
        ct_format: None,
        modelopt_algo: None,
        in_fp8: InFp8::Always,
    },
    synth: None,
};
