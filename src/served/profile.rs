//! Served profiles as data. A profile names what a serving engine's NVFP4 GEMM computes, written
//! as a [`Recipe`]: the weight operand it multiplies, the activation quantizer in front of it and
//! the epilogue after it (docs/NVFP4.md §4). The CPU reference (`served::apply`) and the CUDA
//! backend (the served linear, its observation and the routed experts) both interpret the recipe;
//! nothing else matches on a profile. The tolerance a profile's ops are held to is looked up by its
//! [`Profile::name`] in one place, `probe::tolerance` (the isolated tolerance table).

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Profile {
    BlackwellW4a4,
    HopperW4a16,
    Emulation,
}

/// What the served GEMM multiplies on the weight side of an NVFP4 linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightOperand {
    /// `e2m1 · s_w` (exact in BF16); the tensor scale d_w is left to the epilogue.
    E2m1Scaled,
    /// `bf16(e2m1 · s_w · d_w)`: the weight dequantized to BF16 (vLLM's emulation backend).
    Bf16Dequantized,
}

/// What the served GEMM multiplies on the activation side of an NVFP4 linear.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ActQuant {
    /// The stored BF16 activation as is (its amax is still observed; no health counters).
    Bf16,
    /// NVFP4 codes at the static encode scale g_x (§3.2 op order): the GEMM multiplies
    /// `e2m1 · s_x`, exact block partials.
    Nvfp4Codes,
    /// NVFP4 quantize-dequantize at g_x, rounded to BF16.
    Nvfp4Bf16,
}

/// What multiplies the f32 accumulator before its BF16 rounding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Epilogue {
    /// `bf16(alpha · acc)`, alpha = d_x · d_w.
    Alpha,
    /// `bf16(d_w · acc)` (Marlin's W4A16).
    WeightDecode,
    /// `bf16(acc)`: the scales are already in the operands.
    Round,
}

/// One served NVFP4 linear as data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Recipe {
    pub weight: WeightOperand,
    pub act: ActQuant,
    pub epilogue: Epilogue,
}

impl Recipe {
    /// Whether the activation quantizer's health counters are reported.
    pub fn observes_health(self) -> bool {
        self.act != ActQuant::Bf16
    }
}

impl Epilogue {
    /// The accumulator's multiplier given the loader's scalars (1 for [`Epilogue::Round`]).
    pub fn multiplier(self, p: &super::Nvfp4Params) -> f32 {
        match self {
            Epilogue::Alpha => p.alpha,
            Epilogue::WeightDecode => p.d_w,
            Epilogue::Round => 1.0,
        }
    }
}

impl Profile {
    pub const ALL: [Profile; 3] = [
        Profile::BlackwellW4a4,
        Profile::HopperW4a16,
        Profile::Emulation,
    ];

    pub fn parse(s: &str) -> Result<Profile> {
        match s {
            "blackwell-w4a4" | "w4a4" => Ok(Profile::BlackwellW4a4),
            "hopper-w4a16" | "w4a16" | "marlin" => Ok(Profile::HopperW4a16),
            "emulation" => Ok(Profile::Emulation),
            _ => Err(Error::usage(format!(
                "unknown served profile `{s}` (blackwell-w4a4, hopper-w4a16, emulation)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Profile::BlackwellW4a4 => "blackwell-w4a4",
            Profile::HopperW4a16 => "hopper-w4a16",
            Profile::Emulation => "emulation",
        }
    }

    /// The profile's NVFP4 linear (docs/NVFP4.md §4):
    /// - `blackwell-w4a4`: activations quantized at run time with the static encode scale g_x,
    ///   exact block partials, `bf16(alpha · acc)`;
    /// - `hopper-w4a16`: Marlin, activations stay BF16, `bf16(f32(x · e2m1·s_w) · d_w)`;
    /// - `emulation`: vLLM's emulation backend, quantize-dequantize activation to BF16, weight to
    ///   BF16, BF16 matmul with f32 accumulation.
    pub fn recipe(self) -> Recipe {
        match self {
            Profile::BlackwellW4a4 => Recipe {
                weight: WeightOperand::E2m1Scaled,
                act: ActQuant::Nvfp4Codes,
                epilogue: Epilogue::Alpha,
            },
            Profile::HopperW4a16 => Recipe {
                weight: WeightOperand::E2m1Scaled,
                act: ActQuant::Bf16,
                epilogue: Epilogue::WeightDecode,
            },
            Profile::Emulation => Recipe {
                weight: WeightOperand::Bf16Dequantized,
                act: ActQuant::Nvfp4Bf16,
                epilogue: Epilogue::Round,
            },
        }
    }
}

/// How engines serve a weight whose served operand is its exact dequantized values (FP8 block,
/// MXFP4: `formats::Served::Fp8Act`): which activation each profile multiplies it with. A model
/// family's engines may differ here ([`ExactRecipe::of`]); the weight side and the `bf16(acc)`
/// epilogue are the same for all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExactRecipe {
    /// DeepSeek's own kernels and the block-FP8 engines: FP8 1×128 activations with power-of-two
    /// scales under every profile.
    DeepSeekFp8,
    /// gpt-oss's MXFP4 experts: W4A8 on Blackwell (FlashInfer's TensorRT-LLM MoE, MXFP8
    /// activations), W4A16 on Hopper (Marlin, triton_kernels' `matmul_ogs`: BF16 activations),
    /// and W4A16 under emulation.
    GptOssMxfp4,
}

/// The activation an [`ExactRecipe`] puts in front of the GEMM.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExactAct {
    /// DeepSeek's FP8 1×128 quantize-dequantize (`fp8_block::fake_quant_act_1x128`).
    Fp8x128,
    /// MXFP8 quantize-dequantize, E4M3 per 32 with a UE8M0 scale rounded up
    /// (`fp8_block::fake_quant_act_mxfp8`).
    Mxfp8,
    /// The stored BF16 activation as is.
    Bf16,
}

impl ExactRecipe {
    /// The recipe of a weight stored as `scheme` in a model of family `family` (None: V4).
    pub fn of(
        family: Option<crate::model::family::kind::Kind>,
        scheme: crate::checkpoint::Scheme,
    ) -> ExactRecipe {
        use crate::model::family::kind::Kind;
        match (family, scheme) {
            (Some(Kind::GptOss), crate::checkpoint::Scheme::Mxfp4) => ExactRecipe::GptOssMxfp4,
            _ => ExactRecipe::DeepSeekFp8,
        }
    }

    /// The recipe of a weight stored as `scheme` in `ckpt` (the family its config names; V4's
    /// when the config cannot be read, which the run reports on its own).
    pub fn in_checkpoint(
        ckpt: &crate::checkpoint::Checkpoint,
        scheme: crate::checkpoint::Scheme,
    ) -> ExactRecipe {
        let family = ckpt
            .model_config()
            .ok()
            .and_then(|c| c.family.as_ref().map(|f| f.kind));
        ExactRecipe::of(family, scheme)
    }
}

impl Profile {
    /// What `recipe`'s activation is under this profile.
    pub fn exact_act(self, recipe: ExactRecipe) -> ExactAct {
        match (recipe, self) {
            (ExactRecipe::DeepSeekFp8, _) => ExactAct::Fp8x128,
            (ExactRecipe::GptOssMxfp4, Profile::BlackwellW4a4) => ExactAct::Mxfp8,
            (ExactRecipe::GptOssMxfp4, Profile::HopperW4a16 | Profile::Emulation) => ExactAct::Bf16,
        }
    }
}

/// Which forward a path computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PathKind {
    OracleFp32,
    OracleBf16,
    Served,
}

impl PathKind {
    pub const ALL: [PathKind; 3] = [PathKind::OracleFp32, PathKind::OracleBf16, PathKind::Served];
    pub fn name(self) -> &'static str {
        match self {
            PathKind::OracleFp32 => "oracle_fp32",
            PathKind::OracleBf16 => "oracle_bf16",
            PathKind::Served => "served",
        }
    }
}
