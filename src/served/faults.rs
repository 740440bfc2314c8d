//! The fault catalogue shared by `synth --fault` (planted in the checkpoint) and
//! `run/bisect --loader-fault` (a correct checkpoint read the wrong way by the served path).
//! Kinds are modelled on the field bugs of docs/PRIOR-ART.md §2 and docs/NVFP4.md §7.

use crate::{Error, Result};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FaultKind {
    InvertedInputScale,
    InvertedWeightScale,
    MissingAlpha,
    InputAmaxX64,
    ZeroInputScale,
    MissingInputScale,
    NanInputScale,
    NanBlockScale,
    W13ScaleMismatch,
    NibbleSwap,
    SwizzledScales,
    ShiftedScaleRows,
    NonPow2Ue8m0,
    DoubleScale,
    InfInputScale,
    MissingCorrectionBias,
    SwappedQkNorm,
    GateUpDeinterleaved,
    GateUpInterleavedTwice,
    MissingBlockScales,
    MissingExpertBias,
    ZeroedExpertBias,
    SwigluUnclamped,
    Ue8m0Requantized,
    E8m0BiasOffByOne,
    E4m3ScaleUnbiased,
    Bf16CorrectionBias,
    RoutedScalingDropped,
    RoutedScalingDoubled,
    SinksDropped,
}

impl FaultKind {
    pub const ALL: [FaultKind; 14] = [
        FaultKind::InvertedInputScale,
        FaultKind::InvertedWeightScale,
        FaultKind::MissingAlpha,
        FaultKind::InputAmaxX64,
        FaultKind::ZeroInputScale,
        FaultKind::MissingInputScale,
        FaultKind::NanInputScale,
        FaultKind::NanBlockScale,
        FaultKind::W13ScaleMismatch,
        FaultKind::NibbleSwap,
        FaultKind::SwizzledScales,
        FaultKind::ShiftedScaleRows,
        FaultKind::NonPow2Ue8m0,
        FaultKind::DoubleScale,
    ];

    /// gpt-oss's fused-expert kinds (its `w13` with gate and up rows interleaved, its MXFP4
    /// `*_scales` beside `*_blocks`): planted by `synth --family gpt-oss` and emulated by
    /// `--loader-fault` like [`FaultKind::ALL`]'s, but kept out of that list, whose kinds every
    /// NVFP4 checkpoint can carry (the V4 fault matrices run it).
    pub const FUSED_EXPERTS: [FaultKind; 3] = [
        FaultKind::GateUpDeinterleaved,
        FaultKind::GateUpInterleavedTwice,
        FaultKind::MissingBlockScales,
    ];

    /// Kinds that exist only as planted checkpoint bytes (`synth --fault`): the served path reads
    /// the checkpoint as stored, so a loader has no separate way to get them wrong (a parameter
    /// is read by every numerics path alike). Kept out of [`FaultKind::ALL`].
    pub const CHECKPOINT_ONLY: [FaultKind; 5] = [
        FaultKind::InfInputScale,
        FaultKind::MissingCorrectionBias,
        FaultKind::SwappedQkNorm,
        FaultKind::MissingExpertBias,
        FaultKind::ZeroedExpertBias,
    ];

    /// Kinds of the engine's kernels, not of the checkpoint's tensors: `--loader-fault` emulates
    /// them on the served path, `synth` has no bytes to plant them in.
    pub const ENGINE_ONLY: [FaultKind; 1] = [FaultKind::SwigluUnclamped];

    /// The loader and engine kinds of docs/CATALOGUE-2026.md (issue 43 item 7): emulated by
    /// `--loader-fault` on the served path only; `synth` has no bytes to plant them in (the
    /// checkpoint is right, the engine reads it wrong).
    pub const CATALOGUE_2026: [FaultKind; 7] = [
        FaultKind::Ue8m0Requantized,
        FaultKind::E8m0BiasOffByOne,
        FaultKind::E4m3ScaleUnbiased,
        FaultKind::Bf16CorrectionBias,
        FaultKind::RoutedScalingDropped,
        FaultKind::RoutedScalingDoubled,
        FaultKind::SinksDropped,
    ];

    /// Kinds that act on a plain parameter or a config constant of a layer, not on a weight's
    /// reading: their target is a layer's op (`Ln.ffn.router`, `Ln.ffn.experts`, `Ln.attn`).
    pub fn is_layer_kind(self) -> bool {
        matches!(
            self,
            FaultKind::Bf16CorrectionBias
                | FaultKind::RoutedScalingDropped
                | FaultKind::RoutedScalingDoubled
                | FaultKind::SinksDropped
        )
    }

    /// Every kind: [`FaultKind::ALL`], [`FaultKind::FUSED_EXPERTS`],
    /// [`FaultKind::CHECKPOINT_ONLY`], then [`FaultKind::ENGINE_ONLY`].
    pub fn every() -> impl Iterator<Item = FaultKind> {
        FaultKind::ALL
            .into_iter()
            .chain(FaultKind::FUSED_EXPERTS)
            .chain(FaultKind::CHECKPOINT_ONLY)
            .chain(FaultKind::ENGINE_ONLY)
            .chain(FaultKind::CATALOGUE_2026)
    }

    /// Whether the kind belongs to gpt-oss's fused experts: [`FaultKind::FUSED_EXPERTS`] and the
    /// expert-bias kinds, which `synth` plants when it fuses the experts, not into one linear.
    pub fn is_fused_expert(self) -> bool {
        FaultKind::FUSED_EXPERTS.contains(&self)
            || matches!(
                self,
                FaultKind::MissingExpertBias | FaultKind::ZeroedExpertBias
            )
    }

    /// Whether the kind is one of gpt-oss's gate/up row orders.
    pub fn is_gate_up_order(self) -> bool {
        matches!(
            self,
            FaultKind::GateUpDeinterleaved | FaultKind::GateUpInterleavedTwice
        )
    }

    /// Whether `--loader-fault` can emulate this kind (else it is a checkpoint fault only).
    pub fn has_loader_form(self) -> bool {
        !FaultKind::CHECKPOINT_ONLY.contains(&self)
    }

    pub fn name(self) -> &'static str {
        match self {
            FaultKind::InvertedInputScale => "inverted-input-scale",
            FaultKind::InvertedWeightScale => "inverted-weight-scale",
            FaultKind::MissingAlpha => "missing-alpha",
            FaultKind::InputAmaxX64 => "input-amax-x64",
            FaultKind::ZeroInputScale => "zero-input-scale",
            FaultKind::MissingInputScale => "missing-input-scale",
            FaultKind::NanInputScale => "nan-input-scale",
            FaultKind::NanBlockScale => "nan-block-scale",
            FaultKind::W13ScaleMismatch => "w13-scale-mismatch",
            FaultKind::NibbleSwap => "nibble-swap",
            FaultKind::SwizzledScales => "swizzled-scales",
            FaultKind::ShiftedScaleRows => "shifted-scale-rows",
            FaultKind::NonPow2Ue8m0 => "non-pow2-ue8m0",
            FaultKind::DoubleScale => "double-scale",
            FaultKind::InfInputScale => "inf-input-scale",
            FaultKind::MissingCorrectionBias => "missing-correction-bias",
            FaultKind::SwappedQkNorm => "swapped-qk-norm",
            FaultKind::GateUpDeinterleaved => "gate-up-deinterleaved",
            FaultKind::GateUpInterleavedTwice => "gate-up-interleaved-twice",
            FaultKind::MissingBlockScales => "missing-block-scales",
            FaultKind::MissingExpertBias => "missing-expert-bias",
            FaultKind::ZeroedExpertBias => "zeroed-expert-bias",
            FaultKind::SwigluUnclamped => "swiglu-unclamped",
            FaultKind::Ue8m0Requantized => "ue8m0-requantized",
            FaultKind::E8m0BiasOffByOne => "e8m0-bias-off-by-one",
            FaultKind::E4m3ScaleUnbiased => "e4m3-scale-unbiased",
            FaultKind::Bf16CorrectionBias => "bf16-correction-bias",
            FaultKind::RoutedScalingDropped => "routed-scaling-dropped",
            FaultKind::RoutedScalingDoubled => "routed-scaling-doubled",
            FaultKind::SinksDropped => "sinks-dropped",
        }
    }

    /// One line for `synth --list-faults`.
    pub fn describe(self) -> &'static str {
        match self {
            FaultKind::InvertedInputScale => "activation global scale stored/read in the other producer's convention (reciprocal): vLLM #45212-style loader bug",
            FaultKind::InvertedWeightScale => "weight global scale stored/read as its reciprocal (CT divisor used as ModelOpt multiplier): modular #6600",
            FaultKind::MissingAlpha => "GEMM alpha (d_x·d_w) not applied (=1): output off by g_x·g_w",
            FaultKind::InputAmaxX64 => "activation calibration amax 64× too small: block scales saturate at 448",
            FaultKind::ZeroInputScale => "activation scale 0: 1/0 = inf encode scale, alpha 0 (vLLM #54189)",
            FaultKind::MissingInputScale => "activation scale tensor absent (never calibrated expert): loaded as 0 (vLLM #45212)",
            FaultKind::NanInputScale => "activation scale NaN/Inf (all-zero calibration, compressed-tensors #595)",
            FaultKind::NanBlockScale => "E4M3 block-scale byte 0x7F (unclamped cast, ModelOpt #1633)",
            FaultKind::W13ScaleMismatch => "w1/w3 global scales differ by 1.6×; a fused engine keeps one (vLLM #54974)",
            FaultKind::NibbleSwap => "e2m1 nibbles swapped within each byte (high nibble = even element)",
            FaultKind::SwizzledScales => "block scales stored in the 128×4 swizzled layout where linear belongs (modular #6600)",
            FaultKind::ShiftedScaleRows => "block-scale rows shifted by one (wrong offset / TP slice)",
            FaultKind::NonPow2Ue8m0 => "FP8 block scale not a power of two where UE8M0 is required (sglang #25704)",
            FaultKind::DoubleScale => "a scale applied twice (global scale folded into weights and applied again, vLLM #39407)",
            FaultKind::InfInputScale => "activation scale +Inf: an all-zero calibration of a rarely routed expert (2688/0), the Qwen3-MoE NVFP4 export bug (checkpoint only)",
            FaultKind::MissingCorrectionBias => "DeepSeek-V3 router's e_score_correction_bias left out of the export: routing without it picks other experts (checkpoint only)",
            FaultKind::SwappedQkNorm => "Qwen3 per-head q_norm and k_norm weights stored under each other's names (checkpoint only; lint --reference finds it)",
            FaultKind::GateUpDeinterleaved => "gpt-oss w13 (gate/up interleaved) taken for the stacked layout and de-interleaved: every GLU pair reads the wrong rows (synth: stored stacked)",
            FaultKind::GateUpInterleavedTwice => "gpt-oss w13 interleaved again although the release already interleaves gate and up (synth: stored interleaved twice)",
            FaultKind::MissingBlockScales => "gpt-oss's fused expert block scales left out (synth) or not loaded: MXFP4 `*_scales` (every block read with scale 1, E8M0 127); ModelOpt NVFP4's underscore keys `*_weight_scale`, `*_weight_scale_2`, `*_input_scale` (block, tensor and activation scales left at 1.0: vLLM #46641's NaN / \"!!!!\")",
            FaultKind::MissingExpertBias => "gpt-oss expert biases `*_bias` left out of the export (checkpoint only; lint: weight.missing)",
            FaultKind::ZeroedExpertBias => "gpt-oss expert biases exported as zeros, as a loader that never loaded them would hold them (checkpoint only; lint --reference finds it)",
            FaultKind::SwigluUnclamped => "the experts' SwiGLU run without the config's `swiglu_limit` (gpt-oss 7, DeepSeek-V4 10): an MoE kernel not given the clamp passes gate and up unclamped (engine only: run --loader-fault swiglu-unclamped@Ln.ffn.experts)",
            FaultKind::Ue8m0Requantized => "FP8 block scales rounded up to powers of two (UE8M0) by a DeepGEMM-style loader although the checkpoint's scales are not UE8M0: every block off by up to 2× (sglang #39193, vLLM PR #51372; loader only)",
            FaultKind::E8m0BiasOffByOne => "MXFP4 E8M0 block-scale exponents decoded with bias 128 instead of 127: every block halved (compressed-tensors PR #538, vLLM PR #43557; loader only)",
            FaultKind::E4m3ScaleUnbiased => "NVFP4 E4M3 block scales widened to BF16 without the exponent re-bias (7 → 127): every block ×2^-120, the op's output ≈ 0 (vLLM PR #47315; loader only)",
            FaultKind::Bf16CorrectionBias => "the router's e_score_correction_bias rounded to BF16 before the top-k: near ties pick other experts (sglang PR #31213, vLLM PR #50761; loader only, target Ln.ffn.router)",
            FaultKind::RoutedScalingDropped => "routed_scaling_factor not applied to the routed experts' weights (vLLM PR #46816; engine only, target Ln.ffn.experts)",
            FaultKind::RoutedScalingDoubled => "routed_scaling_factor applied twice, once folded into the routing weights and again on the output (flashinfer #3423; engine only, target Ln.ffn.experts)",
            FaultKind::SinksDropped => "gpt-oss's attention sinks not passed to the attention kernel: softmax without the sink logit (engine only, target Ln.attn)",
        }
    }

    pub fn parse(s: &str) -> Option<FaultKind> {
        FaultKind::every().find(|k| k.name() == s)
    }
}

/// `KIND@TARGET`; TARGET is an op id (`L1.attn.q_b`, `L2.ffn.expert.3.w2`, `L1.ffn.experts` = every
/// expert of the layer), or a canonical weight base (`layers.1.attn.wq_b`).
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Fault {
    pub kind: FaultKind,
    pub target: String,
}

impl Fault {
    pub fn parse(spec: &str) -> Result<Fault> {
        let (k, t) = spec
            .split_once('@')
            .ok_or_else(|| Error::usage(format!("fault `{spec}`: expected KIND@TARGET")))?;
        let kind = FaultKind::parse(k).ok_or_else(|| {
            Error::usage(format!(
                "fault `{spec}`: unknown kind `{k}` (known: {})",
                FaultKind::every()
                    .map(|k| k.name())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))
        })?;
        if t.is_empty() {
            return Err(Error::usage(format!("fault `{spec}`: empty target")));
        }
        Ok(Fault {
            kind,
            target: t.to_string(),
        })
    }

    /// Does this fault's target cover the weight `base` (canonical, e.g. `layers.1.ffn.experts.3.w1`)?
    pub fn hits(&self, base: &str) -> bool {
        target_bases_match(&self.target, base)
    }
}

/// The loader faults among `faults` that hit weight `base`.
pub fn hitting<'a>(faults: &'a [Fault], base: &str) -> Vec<&'a Fault> {
    faults.iter().filter(|f| f.hits(base)).collect()
}

/// Whether the served path can emulate `kind` as a loader fault on a weight of `scheme`
/// (a scheme label of `Checkpoint::weight_scheme`).
/// Decided by the format's served recipe (the format table): every NVFP4 loader fault but the
/// FP8 activation's; on the FP8-activation formats the non-power-of-two activation scale, and
/// the double-applied scale where the scales are FP8 block's f32 multipliers.
/// gpt-oss's kinds: the gate/up row orders on every quantized weight (MXFP4, FP8 and NVFP4: the
/// reading permutes the decoded rows, and [`check_loader_faults`] also asks for a `w13`) — a
/// BF16 weight is served as the BF16 oracle reads it, so the runner measures no loader fault on
/// it —, unloaded block scales on MXFP4 and ModelOpt NVFP4; the unclamped SwiGLU on the experts
/// of any quantized format.
pub fn loader_fault_applies(kind: FaultKind, scheme: &str) -> bool {
    use crate::checkpoint::formats::Served;
    use crate::checkpoint::Scheme;
    let Some(s) = Scheme::from_label(scheme) else {
        return false;
    };
    if !kind.has_loader_form() {
        return false;
    }
    if kind == FaultKind::SwigluUnclamped || kind.is_gate_up_order() {
        // a row order, or the clamp between the projections, is any quantized format's to get
        // wrong; BF16 is served as the oracle reads it (no engine numerics to emulate)
        return s.spec().served != Served::Dense;
    }
    if kind == FaultKind::MissingBlockScales {
        return matches!(s, Scheme::Mxfp4 | Scheme::Nvfp4ModelOpt);
    }
    match kind {
        FaultKind::Ue8m0Requantized => return s == Scheme::Fp8Block,
        FaultKind::E8m0BiasOffByOne => return s == Scheme::Mxfp4,
        FaultKind::E4m3ScaleUnbiased => return s.spec().served == Served::Nvfp4,
        // a layer's parameter or constant, never a weight's reading (`check_layer_target`)
        k if k.is_layer_kind() => return false,
        _ => {}
    }
    match s.spec().served {
        Served::Nvfp4 => kind != FaultKind::NonPow2Ue8m0,
        Served::Fp8Act => {
            kind == FaultKind::NonPow2Ue8m0
                || (kind == FaultKind::DoubleScale && s == Scheme::Fp8Block)
        }
        Served::Dense => false,
    }
}

/// Refuse loader faults whose target matches no weight, or no weight the fault can apply to.
pub fn check_loader_faults(
    ckpt: &crate::checkpoint::Checkpoint,
    faults: &[Fault],
) -> crate::Result<()> {
    if faults.is_empty() {
        return Ok(());
    }
    let bases = ckpt.weight_bases();
    for f in faults {
        if !f.kind.has_loader_form() {
            return Err(Error::usage(format!(
                "loader fault {}@{}: {} exists only in a checkpoint's bytes; plant it with `synth --fault {}@{}`",
                f.kind.name(),
                f.target,
                f.kind.name(),
                f.kind.name(),
                f.target
            )));
        }
        if f.kind == FaultKind::SwigluUnclamped {
            check_swiglu_target(ckpt, f)?;
        }
        if f.kind.is_layer_kind() {
            check_layer_target(ckpt, f)?;
            continue;
        }
        let hits: Vec<&String> = bases.iter().filter(|b| f.hits(b)).collect();
        if hits.is_empty() {
            return Err(Error::usage(format!(
                "loader fault {}@{}: the target matches no weight of the checkpoint",
                f.kind.name(),
                f.target
            )));
        }
        if f.kind.is_gate_up_order() && !hits.iter().any(|b| is_w13(b)) {
            return Err(Error::usage(format!(
                "loader fault {}@{}: needs gpt-oss's fused gate/up weight `w13` (targets like L1.ffn.experts)",
                f.kind.name(),
                f.target
            )));
        }
        let schemes: Vec<&str> = hits.iter().filter_map(|b| ckpt.weight_scheme(b)).collect();
        if !schemes.iter().any(|s| loader_fault_applies(f.kind, s)) {
            let mut uniq = schemes.clone();
            uniq.sort();
            uniq.dedup();
            return Err(Error::usage(format!(
                "loader fault {}@{}: does not apply to the target's format ({})",
                f.kind.name(),
                f.target,
                uniq.join(", ")
            )));
        }
    }
    Ok(())
}

/// `swiglu-unclamped` needs a model whose experts clamp (`swiglu_limit` > 0) and a whole op as its
/// target: the clamp is one kernel argument for every expert of a layer (`Ln.ffn.experts`; V4's
/// shared expert, `Ln.ffn.shared`, clamps too).
fn check_swiglu_target(ckpt: &crate::checkpoint::Checkpoint, f: &Fault) -> crate::Result<()> {
    let refuse = |why: String| {
        Err(Error::usage(format!(
            "loader fault {}@{}: {why}",
            f.kind.name(),
            f.target
        )))
    };
    let cfg = ckpt.model_config()?;
    if cfg.swiglu_limit.is_nan() || cfg.swiglu_limit <= 0.0 {
        return refuse(
            "the model's experts have no SwiGLU clamp (`swiglu_limit` absent or 0 in config.json)"
                .into(),
        );
    }
    let op = f.target.strip_prefix('L').and_then(|r| r.split_once('.'));
    let ok = match op {
        Some((n, rest)) => {
            n.parse::<usize>().is_ok_and(|n| n < cfg.num_hidden_layers)
                && (rest == "ffn.experts" || (rest == "ffn.shared" && cfg.family.is_none()))
        }
        None => false,
    };
    if !ok {
        return refuse(format!(
            "the clamp is one kernel argument for a layer's routed experts: target Ln.ffn.experts{} (n < {})",
            if cfg.family.is_none() {
                " or Ln.ffn.shared"
            } else {
                ""
            },
            cfg.num_hidden_layers
        ));
    }
    Ok(())
}

/// The SwiGLU clamp a path uses for the experts op reading weight `weight` (any of the op's
/// weights; the fault targets the whole op): the config's `limit`, or none (+inf) on the served
/// path (`served`) under `swiglu-unclamped`, unless bisect's repair restores it.
pub fn swiglu_limit(
    limit: f32,
    served: bool,
    faults: &[Fault],
    overrides: &[(String, super::Override)],
    weight: &str,
) -> f32 {
    let unclamped = served
        && hitting(faults, weight)
            .iter()
            .any(|f| f.kind == FaultKind::SwigluUnclamped)
        && !super::overrides_of(overrides, weight).contains(&super::Override::SwigluClamp);
    if unclamped {
        f32::INFINITY
    } else {
        limit
    }
}

/// A layer kind's target: a layer the checkpoint holds, with the parameter or constant the
/// kind acts on (the router's correction bias, the attention sinks, a routed scaling ≠ 1).
fn check_layer_target(ckpt: &crate::checkpoint::Checkpoint, f: &Fault) -> crate::Result<()> {
    let refuse = |why: String| {
        Err(Error::usage(format!(
            "loader fault {}@{}: {why}",
            f.kind.name(),
            f.target
        )))
    };
    let Some(n) = target_layer(&f.target) else {
        return refuse(
            "the target must be a layer's op (e.g. L1.ffn.router, L1.ffn.experts, L1.attn)".into(),
        );
    };
    let names = ckpt.canonical_names();
    let has = |suffix: &str| names.iter().any(|c| *c == format!("layers.{n}.{suffix}"));
    match f.kind {
        FaultKind::Bf16CorrectionBias if !has("ffn.gate.bias") => refuse(format!(
            "layer {n} has no router correction bias (e_score_correction_bias)"
        )),
        FaultKind::SinksDropped if !has("attn.attn_sink") => {
            refuse(format!("layer {n} has no attention sinks"))
        }
        FaultKind::RoutedScalingDropped | FaultKind::RoutedScalingDoubled => {
            let rs = ckpt
                .model_config()
                .map(|c| c.routed_scaling_factor)
                .unwrap_or(1.0);
            let moe = names
                .iter()
                .any(|c| c.starts_with(&format!("layers.{n}.ffn.experts.")));
            if !moe {
                refuse(format!("layer {n} has no routed experts"))
            } else if rs == 1.0 {
                refuse(
                    "the config's routed_scaling_factor is 1: nothing to drop or apply twice"
                        .into(),
                )
            } else {
                Ok(())
            }
        }
        _ => Ok(()),
    }
}

/// Whether a layer kind (docs/CATALOGUE-2026.md) acts at op `op_id`'s layer: the served path then
/// differs from the BF16 oracle there even where no weight is quantized (a router, an attention).
pub fn layer_fault_at(faults: &[Fault], op_id: &str) -> bool {
    let Some(l) = target_layer(op_id) else {
        return false;
    };
    faults
        .iter()
        .any(|f| f.kind.is_layer_kind() && target_layer(&f.target) == Some(l))
}

/// A parameter as the served path reads it under the layer kinds among `faults`: the router's
/// correction bias rounded to BF16 (`bf16-correction-bias`), the attention sinks dropped (a sink
/// logit of -inf adds exp(-inf) = 0 to every softmax denominator: `sinks-dropped`). None when
/// no fault touches `canonical`.
pub fn param_reading(
    faults: &[Fault],
    canonical: &str,
    t: &crate::Tensor,
) -> Option<crate::Tensor> {
    let layer = canonical
        .strip_prefix("layers.")?
        .split('.')
        .next()?
        .parse::<usize>()
        .ok()?;
    let hit = |k: FaultKind| {
        faults
            .iter()
            .any(|f| f.kind == k && target_layer(&f.target) == Some(layer))
    };
    if canonical.ends_with(".ffn.gate.bias") && hit(FaultKind::Bf16CorrectionBias) {
        let mut u = t.clone();
        u.data
            .iter_mut()
            .for_each(|v| *v = crate::numerics::bf16::round(*v));
        return Some(u);
    }
    if canonical.ends_with(".attn.attn_sink") && hit(FaultKind::SinksDropped) {
        let mut u = t.clone();
        u.data.iter_mut().for_each(|v| *v = f32::NEG_INFINITY);
        return Some(u);
    }
    None
}

/// The factor the routed experts of layer `layer` apply to routing weights that carry the
/// config's scaling `rs`: 1 on the oracles, 1/rs (dropped) or rs (applied twice) on the served
/// path (`served`) under `routed-scaling-dropped` / `-doubled`.
pub fn routed_weight_factor(rs: f32, served: bool, faults: &[Fault], layer: usize) -> f32 {
    if !served {
        return 1.0;
    }
    let hit = |k: FaultKind| {
        faults
            .iter()
            .any(|f| f.kind == k && target_layer(&f.target) == Some(layer))
    };
    if hit(FaultKind::RoutedScalingDropped) {
        1.0 / rs
    } else if hit(FaultKind::RoutedScalingDoubled) {
        rs
    } else {
        1.0
    }
}

/// The values a loader with a scale-decoding fault serves for a non-NVFP4 weight: FP8 block
/// scales rounded up to powers of two (`ue8m0-requantized`), MXFP4 exponents read with bias 128
/// (`e8m0-bias-off-by-one`). None when neither applies.
fn scale_decoding_reading(
    qw: &crate::checkpoint::QuantWeight,
    dequant: &[f32],
    faults: &[&Fault],
) -> Option<Vec<f32>> {
    use crate::checkpoint::WeightFormat;
    let has = |k: FaultKind| faults.iter().any(|f| f.kind == k);
    let (rows, cols) = (qw.out_features, qw.in_features);
    match &qw.format {
        WeightFormat::Mxfp4 { packed, scales } if has(FaultKind::E8m0BiasOffByOne) => {
            let sc: Vec<u8> = scales.iter().map(|b| b.saturating_sub(1)).collect();
            Some(crate::numerics::mxfp4::dequantize(packed, &sc, rows, cols))
        }
        WeightFormat::Fp8Block { scales, block, .. } if has(FaultKind::Ue8m0Requantized) => {
            let sc = cols.div_ceil(block[1]);
            let mut w = dequant.to_vec();
            for r in 0..rows {
                for c in 0..cols {
                    let s = scales[(r / block[0]) * sc + c / block[1]];
                    if s.is_finite() && s > 0.0 {
                        w[r * cols + c] *= s.log2().ceil().exp2() / s;
                    }
                }
            }
            Some(w)
        }
        _ => None,
    }
}

/// Whether `base` is gpt-oss's fused gate/up projection of a routed expert (`….experts.3.w13`).
pub fn is_w13(base: &str) -> bool {
    base.contains(".ffn.experts.") && base.ends_with(".w13")
}

/// gpt-oss's `w13` [2I, D] holds gate row i at row 2i and up row i at row 2i + 1 (the release's
/// layout, the op reads it so). `deinterleave` is what a loader does that takes it for the stacked
/// layout (gate rows, then up rows): row i ← row 2i, row I + i ← row 2i + 1. `rows` rows of
/// `v.len() / rows` elements each; `rows` even.
pub fn deinterleave<T: Copy>(v: &[T], rows: usize) -> Vec<T> {
    let (half, w) = (rows / 2, v.len() / rows.max(1));
    let mut out = Vec::with_capacity(v.len());
    for parity in 0..2 {
        for i in 0..half {
            out.extend_from_slice(&v[(2 * i + parity) * w..(2 * i + parity + 1) * w]);
        }
    }
    out
}

/// The inverse of [`deinterleave`]: row 2i ← row i, row 2i + 1 ← row I + i (a loader that
/// interleaves a `w13` it takes for stacked, though the release interleaves it already).
pub fn interleave<T: Copy>(v: &[T], rows: usize) -> Vec<T> {
    let (half, w) = (rows / 2, v.len() / rows.max(1));
    let mut out = Vec::with_capacity(v.len());
    for i in 0..half {
        out.extend_from_slice(&v[i * w..(i + 1) * w]);
        out.extend_from_slice(&v[(half + i) * w..(half + i + 1) * w]);
    }
    out
}

/// The values a loader with gpt-oss's fused-expert faults serves for `qw` (whose dequantized values
/// are `dequant`), bisect's repairs applied after it: MXFP4 blocks read without their `_scales`
/// (every scale 1, E8M0 127) unless the repair re-reads them, `w13`'s rows de-interleaved or
/// interleaved again, then re-ordered by a repair. None when nothing applies (serve `dequant`).
/// NVFP4 weights re-order their decoded operand with [`reorder_w13`] instead (their block scales
/// are the served layout's business).
pub fn fused_expert_reading(
    qw: &crate::checkpoint::QuantWeight,
    dequant: &[f32],
    faults: &[&Fault],
    overrides: &[super::Override],
) -> Option<Vec<f32>> {
    let (rows, cols) = (qw.out_features, qw.in_features);
    let mut w: Option<Vec<f32>> = None;
    if reads_without_mxfp4_scales(qw.format.scheme(), faults, overrides) {
        if let crate::checkpoint::WeightFormat::Mxfp4 { packed, .. } = &qw.format {
            let ones = vec![crate::numerics::ue8m0::BIAS as u8; rows * cols / 32];
            w = Some(crate::numerics::mxfp4::dequantize(
                packed, &ones, rows, cols,
            ));
        }
    }
    if w.is_none() {
        w = scale_decoding_reading(qw, dequant, faults);
    }
    let src = w.as_deref().unwrap_or(dequant);
    reorder_w13(&qw.canonical, rows, faults, overrides, src).or(w)
}

/// Whether an MXFP4 weight is read without its `_scales` (the loader fault, no re-reading repair).
fn reads_without_mxfp4_scales(
    scheme: crate::checkpoint::Scheme,
    faults: &[&Fault],
    overrides: &[super::Override],
) -> bool {
    scheme == crate::checkpoint::Scheme::Mxfp4
        && faults
            .iter()
            .any(|f| f.kind == FaultKind::MissingBlockScales)
        && !overrides.contains(&super::Override::StoredBlockScales)
}

/// Whether a loader fault or a repair re-orders the rows of weight `base` (gpt-oss's `w13`).
pub fn reorders_w13(base: &str, faults: &[&Fault], overrides: &[super::Override]) -> bool {
    use super::Override;
    is_w13(base)
        && (faults.iter().any(|f| f.kind.is_gate_up_order())
            || overrides
                .iter()
                .any(|o| matches!(o, Override::InterleaveGateUp | Override::DeinterleaveGateUp)))
}

/// Whether the served reading of `base` (stored as `scheme`) is values the host prepares
/// (`served::prepare`), not the stored bytes a device decodes: a `w13` whose rows a loader or a
/// repair re-orders, MXFP4 blocks read without their scales, and block-scale layout faults and
/// repairs on a format other than NVFP4 (NVFP4's rearranged scale bytes are decoded on the device).
pub fn needs_host_reading(
    base: &str,
    scheme: crate::checkpoint::Scheme,
    faults: &[&Fault],
    overrides: &[super::Override],
) -> bool {
    use super::Override;
    let layout = scheme.spec().served != crate::checkpoint::formats::Served::Nvfp4
        && (faults.iter().any(|f| {
            matches!(
                f.kind,
                FaultKind::SwizzledScales | FaultKind::ShiftedScaleRows | FaultKind::NanBlockScale
            )
        }) || overrides
            .iter()
            .any(|o| matches!(o, Override::Unswizzle | Override::UnshiftRows)));
    let decoding = faults.iter().any(|f| {
        matches!(
            f.kind,
            FaultKind::E8m0BiasOffByOne | FaultKind::Ue8m0Requantized
        )
    });
    layout
        || decoding
        || reorders_w13(base, faults, overrides)
        || reads_without_mxfp4_scales(scheme, faults, overrides)
}

/// `w13`'s rows ([rows, len / rows] values `v`) as the loader reads them: de-interleaved or
/// interleaved again by its fault, then re-ordered by bisect's repairs in their order. None when
/// nothing re-orders `base`.
pub fn reorder_w13<T: Copy>(
    base: &str,
    rows: usize,
    faults: &[&Fault],
    overrides: &[super::Override],
    v: &[T],
) -> Option<Vec<T>> {
    use super::Override;
    if !reorders_w13(base, faults, overrides) || !rows.is_multiple_of(2) {
        return None;
    }
    let has = |k: FaultKind| faults.iter().any(|f| f.kind == k);
    let mut w: Option<Vec<T>> = None;
    let mut step = |f: fn(&[T], usize) -> Vec<T>| {
        w = Some(f(w.as_deref().unwrap_or(v), rows));
    };
    if has(FaultKind::GateUpDeinterleaved) {
        step(deinterleave);
    }
    if has(FaultKind::GateUpInterleavedTwice) {
        step(interleave);
    }
    for o in overrides {
        match o {
            Override::InterleaveGateUp => step(interleave),
            Override::DeinterleaveGateUp => step(deinterleave),
            _ => {}
        }
    }
    w
}

/// The layer a fault target names: `L3.ffn.experts`, `L3`, `layers.3.ffn.experts.0.w1` or a
/// checkpoint name holding `layers.3.`; `None` for targets outside the layers (`head`, `embed`).
pub fn target_layer(target: &str) -> Option<usize> {
    let num = |rest: &str| -> Option<usize> {
        let digits: String = rest.chars().take_while(|c| c.is_ascii_digit()).collect();
        let after = &rest[digits.len()..];
        (!digits.is_empty() && (after.is_empty() || after.starts_with('.')))
            .then(|| digits.parse().ok())
            .flatten()
    };
    if let Some(n) = target.strip_prefix('L').and_then(num) {
        return Some(n);
    }
    let i = target.find("layers.")?;
    if i > 0 && !target[..i].ends_with('.') {
        return None;
    }
    num(&target[i + "layers.".len()..])
}

/// Refuse loader faults whose target lies in a layer the run does not probe (`--layers A..B`,
/// inclusive): the served path reads no weight of it, so the fault would silently change
/// nothing.
pub fn check_fault_layers(faults: &[Fault], (a, b): (usize, usize)) -> Result<()> {
    for f in faults {
        if let Some(l) = target_layer(&f.target).filter(|l| !(a..=b).contains(l)) {
            return Err(Error::usage(format!(
                "loader fault {}@{}: targets layer {l}, outside the layers this run probes (--layers {a}..{b}); \
                 the served path reads no weight of it, so the fault would change nothing (widen --layers to include L{l})",
                f.kind.name(),
                f.target
            )));
        }
    }
    Ok(())
}

/// Op id → canonical weight base prefix rules: `L1.attn.q_a` ↔ `layers.1.attn.wq_a`,
/// `L1.ffn.expert.3.w1` ↔ `layers.1.ffn.experts.3.w1`, `L1.ffn.experts` ↔ every routed expert of
/// layer 1, `L1.ffn.shared` ↔ the shared expert, `L1.attn.wo_a`, `L1.attn.compressor`, …; the
/// families' ops (`model::family::graph`): `L1.attn.q` ↔ `attn.q_proj`, `L1.attn.kv_a` ↔
/// `attn.kv_a_proj_with_mqa`, `L0.ffn.mlp` ↔ the dense MLP's three projections, …
pub fn target_bases_match(target: &str, base: &str) -> bool {
    if target == base || base.starts_with(&format!("{target}.")) {
        return true;
    }
    if let Some(b) = op_target_to_base_prefix(target) {
        return base == b || base.starts_with(&format!("{b}."));
    }
    // the dense MLP op reads three weights that share no prefix beyond the layer's `ffn.`
    if let Some(n) = target
        .strip_prefix('L')
        .and_then(|r| r.strip_suffix(".ffn.mlp"))
    {
        return DENSE_MLP
            .iter()
            .any(|p| base == format!("layers.{n}.ffn.{p}"));
    }
    false
}

/// The dense MLP's projections (Qwen3-MoE's `mlp_only_layers`, DeepSeek-V3's leading layers).
const DENSE_MLP: [&str; 3] = ["gate_proj", "up_proj", "down_proj"];

/// The families' single-weight ops: (op id tail, canonical weight tail).
const FAMILY_OPS: [(&str, &str); 6] = [
    ("attn.q", "attn.q_proj"),
    ("attn.k", "attn.k_proj"),
    ("attn.v", "attn.v_proj"),
    ("attn.o", "attn.o_proj"),
    ("attn.kv_a", "attn.kv_a_proj_with_mqa"),
    ("attn.kv_b", "attn.kv_b_proj"),
];

fn op_target_to_base_prefix(target: &str) -> Option<String> {
    let rest = target.strip_prefix('L')?;
    let (n, op) = rest.split_once('.')?;
    let n: usize = n.parse().ok()?;
    let mapped = match op {
        "attn.q_a" => "attn.wq_a".to_string(),
        "attn.kv" => "attn.wkv".to_string(),
        "attn.q_b" => "attn.wq_b".to_string(),
        "attn.wo_a" => "attn.wo_a".to_string(),
        "attn.wo_b" => "attn.wo_b".to_string(),
        "attn.compressor" => "attn.compressor".to_string(),
        "attn.indexer" => "attn.indexer".to_string(),
        "ffn.router" => "ffn.gate".to_string(),
        "ffn.experts" => "ffn.experts".to_string(),
        "ffn.shared" => "ffn.shared_experts".to_string(),
        o => {
            if let Some((_, w)) = FAMILY_OPS.iter().find(|(id, _)| *id == o) {
                w.to_string()
            } else if let Some(e) = o.strip_prefix("ffn.expert.") {
                format!("ffn.experts.{e}")
            } else if let Some(s) = o.strip_prefix("ffn.shared.") {
                format!("ffn.shared_experts.{s}")
            } else {
                return None;
            }
        }
    };
    Some(format!("layers.{n}.{mapped}"))
}

/// The op id whose output a weight base feeds (inverse of the mapping above), for reports.
pub fn op_of_base(base: &str) -> Option<String> {
    let rest = base.strip_prefix("layers.")?;
    let (n, w) = rest.split_once('.')?;
    let op = if let Some(e) = w.strip_prefix("ffn.experts.") {
        return Some(format!("L{n}.ffn.experts")).filter(|_| !e.is_empty());
    } else if w.starts_with("ffn.shared_experts") {
        "ffn.shared"
    } else if w.starts_with("attn.compressor") {
        "attn.compressor"
    } else if w.starts_with("attn.indexer") {
        "attn.indexer"
    } else if let Some((id, _)) = FAMILY_OPS.iter().find(|(_, b)| *b == w) {
        id
    } else if DENSE_MLP.iter().any(|p| w == format!("ffn.{p}")) {
        "ffn.mlp"
    } else {
        match w {
            "attn.wq_a" => "attn.q_a",
            "attn.wkv" => "attn.kv",
            "attn.wq_b" => "attn.q_b",
            "attn.wo_a" => "attn.wo_a",
            "attn.wo_b" => "attn.wo_b",
            "ffn.gate" | "ffn.gate.weight" | "ffn.gate.bias" => "ffn.router",
            // norm weights (`reference.param` findings)
            "attn_norm" => "attn.norm",
            "ffn_norm" => "ffn.norm",
            "attn.q_norm" | "attn.q_a_layernorm" => "attn.q_norm",
            "attn.k_norm" => "attn.k_norm",
            "attn.kv_norm" => "attn.kv_norm",
            _ => return None,
        }
    };
    Some(format!("L{n}.{op}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_match() {
        let f = Fault::parse("inverted-input-scale@L1.ffn.experts").unwrap();
        assert_eq!(f.kind, FaultKind::InvertedInputScale);
        assert!(f.hits("layers.1.ffn.experts.3.w1"));
        assert!(!f.hits("layers.1.ffn.shared_experts.w1"));
        assert!(!f.hits("layers.11.ffn.experts.3.w1"));
        let g = Fault::parse("nibble-swap@L2.ffn.expert.5.w2").unwrap();
        assert!(g.hits("layers.2.ffn.experts.5.w2"));
        assert!(!g.hits("layers.2.ffn.experts.5.w1"));
        assert!(Fault::parse("nope@L1.attn.q_a").is_err());
        assert!(Fault::parse("nibble-swap").is_err());
        let h = Fault::parse("missing-alpha@layers.0.attn.wq_a").unwrap();
        assert!(h.hits("layers.0.attn.wq_a"));
        assert!(Fault::parse("missing-alpha@L0.attn.q_a")
            .unwrap()
            .hits("layers.0.attn.wq_a"));
        assert_eq!(
            op_of_base("layers.0.ffn.experts.3.w1").as_deref(),
            Some("L0.ffn.experts")
        );
        assert_eq!(
            op_of_base("layers.4.attn.wq_b").as_deref(),
            Some("L4.attn.q_b")
        );
    }

    /// The families' op ids reach their weights and back (`model::family::graph`'s ids).
    #[test]
    fn family_ops_map_to_their_weights() {
        for (op, base) in [
            ("L1.attn.q", "layers.1.attn.q_proj"),
            ("L1.attn.o", "layers.1.attn.o_proj"),
            ("L2.attn.kv_a", "layers.2.attn.kv_a_proj_with_mqa"),
            ("L2.attn.kv_b", "layers.2.attn.kv_b_proj"),
            ("L0.ffn.mlp", "layers.0.ffn.up_proj"),
            ("L3.ffn.router", "layers.3.ffn.gate.bias"),
        ] {
            assert!(target_bases_match(op, base), "{op} {base}");
            assert_eq!(op_of_base(base).as_deref(), Some(op), "{base}");
        }
        assert!(!target_bases_match(
            "L1.attn.q",
            "layers.1.attn.q_norm.weight"
        ));
        assert!(!target_bases_match("L1.attn.k", "layers.1.attn.kv_b_proj"));
        assert!(!target_bases_match("L0.ffn.mlp", "layers.0.ffn.gate"));
        assert!(!target_bases_match("L0.ffn.mlp", "layers.1.ffn.up_proj"));
    }

    #[test]
    fn fault_targets_outside_the_layers_run_are_refused() {
        for (t, l) in [
            ("L3.ffn.experts", Some(3)),
            ("L12.attn.q_a", Some(12)),
            ("L3", Some(3)),
            ("layers.3.ffn.experts.0.w1", Some(3)),
            ("model.layers.7.mlp.experts", Some(7)),
            ("head", None),
            ("Lx.ffn", None),
            ("sublayers.3.x", None),
        ] {
            assert_eq!(target_layer(t), l, "{t}");
        }
        let f = |s: &str| Fault::parse(s).unwrap();
        let e = check_fault_layers(&[f("inverted-input-scale@L3.ffn.experts")], (0, 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("inverted-input-scale@L3.ffn.experts") && e.contains("--layers 0..1"),
            "{e}"
        );
        assert!(check_fault_layers(&[f("inverted-input-scale@L2.ffn.experts")], (3, 4)).is_err());
        check_fault_layers(&[f("inverted-input-scale@L1.ffn.experts")], (0, 1)).unwrap();
        check_fault_layers(&[f("inverted-input-scale@head")], (0, 1)).unwrap();
    }

    #[test]
    fn checkpoint_only_kinds_have_no_loader_form() {
        for k in FaultKind::CHECKPOINT_ONLY {
            assert!(!k.has_loader_form() && !FaultKind::ALL.contains(&k));
            assert_eq!(FaultKind::parse(k.name()), Some(k));
            assert!(!loader_fault_applies(k, "nvfp4-ct"));
        }
        assert!(loader_fault_applies(FaultKind::NanInputScale, "nvfp4-ct"));
    }

    /// gpt-oss's loader kinds: gate/up orders on the exactly dequantized formats, unloaded scales
    /// on MXFP4 only; not in the V4 list.
    #[test]
    fn fused_expert_kinds_apply_where_their_tensors_are() {
        for k in FaultKind::FUSED_EXPERTS {
            assert!(k.has_loader_form() && !FaultKind::ALL.contains(&k));
        }
        let g = FaultKind::GateUpDeinterleaved;
        assert!(loader_fault_applies(g, "mxfp4") && loader_fault_applies(g, "fp8-block"));
        // a row order is any quantized format's to get wrong (ModelOpt's NVFP4 gpt-oss export
        // too); BF16 is served as the oracles read it
        assert!(loader_fault_applies(g, "nvfp4-modelopt") && loader_fault_applies(g, "nvfp4-ct"));
        assert!(!loader_fault_applies(g, "bf16"));
        assert!(loader_fault_applies(FaultKind::MissingBlockScales, "mxfp4"));
        assert!(!loader_fault_applies(FaultKind::MissingBlockScales, "bf16"));
        // ModelOpt's underscore scale keys of gpt-oss's fused NVFP4 experts (vLLM #46641)
        assert!(loader_fault_applies(
            FaultKind::MissingBlockScales,
            "nvfp4-modelopt"
        ));
        assert!(!loader_fault_applies(
            FaultKind::MissingBlockScales,
            "nvfp4-ct"
        ));
        assert!(is_w13("layers.1.ffn.experts.3.w13") && !is_w13("layers.1.ffn.experts.3.w2"));
    }

    /// Rows [g0, u0, g1, u1, g2, u2] de-interleave to [g0, g1, g2, u0, u1, u2]; interleaving undoes
    /// it, and interleaving the interleaved rows is another order again.
    #[test]
    fn gate_up_orders_are_inverse_row_permutations() {
        let rows = ["g0", "u0", "g1", "u1", "g2", "u2"];
        // two elements per row
        let v: Vec<&str> = rows.iter().flat_map(|r| [*r, *r]).collect();
        let d = deinterleave(&v, 6);
        let firsts: Vec<&str> = d.chunks(2).map(|c| c[0]).collect();
        assert_eq!(firsts, ["g0", "g1", "g2", "u0", "u1", "u2"]);
        assert_eq!(interleave(&d, 6), v);
        let twice: Vec<&str> = interleave(&v, 6).chunks(2).map(|c| c[0]).collect();
        assert_eq!(twice, ["g0", "u1", "u0", "g2", "g1", "u2"]);
        assert_eq!(deinterleave(&interleave(&v, 6), 6), v);
    }

    /// The 2026 catalogue's kinds: each applies to the format it models, the layer kinds to no
    /// weight (their target is a layer's op); the served path alone reads them.
    #[test]
    fn catalogue_2026_kinds_apply_where_they_model() {
        use FaultKind as K;
        assert!(loader_fault_applies(K::Ue8m0Requantized, "fp8-block"));
        assert!(!loader_fault_applies(K::Ue8m0Requantized, "nvfp4-ct"));
        assert!(loader_fault_applies(K::E8m0BiasOffByOne, "mxfp4"));
        assert!(!loader_fault_applies(K::E8m0BiasOffByOne, "fp8-block"));
        assert!(loader_fault_applies(K::E4m3ScaleUnbiased, "nvfp4-modelopt"));
        assert!(!loader_fault_applies(K::E4m3ScaleUnbiased, "mxfp4"));
        for k in FaultKind::CATALOGUE_2026 {
            assert!(k.has_loader_form() && !FaultKind::ALL.contains(&k));
            if k.is_layer_kind() {
                assert!(!loader_fault_applies(k, "nvfp4-ct"));
            }
        }
        let f = |s: &str| vec![Fault::parse(s).unwrap()];
        let drop = f("routed-scaling-dropped@L1.ffn.experts");
        assert_eq!(routed_weight_factor(2.5, true, &drop, 1), 0.4);
        assert_eq!(routed_weight_factor(2.5, true, &drop, 2), 1.0);
        assert_eq!(routed_weight_factor(2.5, false, &drop, 1), 1.0);
        let twice = f("routed-scaling-doubled@L1.ffn.experts");
        assert_eq!(routed_weight_factor(2.5, true, &twice, 1), 2.5);
        let t = crate::Tensor::new(vec![2], vec![4.0155, -1.0]);
        let b = param_reading(
            &f("bf16-correction-bias@L1.ffn.router"),
            "layers.1.ffn.gate.bias",
            &t,
        )
        .unwrap();
        assert_eq!(b.data, vec![4.0, -1.0]);
        assert!(param_reading(
            &f("bf16-correction-bias@L1.ffn.router"),
            "layers.2.ffn.gate.bias",
            &t
        )
        .is_none());
        let s = param_reading(&f("sinks-dropped@L1.attn"), "layers.1.attn.attn_sink", &t).unwrap();
        assert!(s.data.iter().all(|v| *v == f32::NEG_INFINITY));
        assert!(layer_fault_at(&f("sinks-dropped@L1.attn"), "L1.attn.core"));
        assert!(!layer_fault_at(&f("sinks-dropped@L1.attn"), "L2.attn.core"));
    }

    #[test]
    fn every_kind_round_trips() {
        for k in FaultKind::every() {
            assert_eq!(FaultKind::parse(k.name()), Some(k));
            assert!(!k.describe().is_empty());
        }
    }
}
