//! The served path: what a serving engine computes for one linear, given the checkpoint's bytes and
//! the way its loader reads them. Low in the crate (it reads `checkpoint` and `numerics`, and
//! nothing above): the backends and the model import their served types from here.
//! - [`profile`]: the served profiles as data (a [`Recipe`] per profile) and the numerics paths;
//! - [`faults`]: the loader-fault catalogue (`--loader-fault`, `synth --fault`);
//! - this module: the loader's reading of a weight ([`prepare`], [`resolve_nvfp4`], bisect's
//!   [`Override`]s) and the CPU reference of the served linear ([`apply`]).
//!
//! FP8 block and MXFP4 weights use DeepSeek's FP8 1×128 activation quantization (power-of-two
//! scales, docs/DSV4-LAYER.md §5 L1); BF16 weights are a BF16 GEMM with f32 output.

use std::sync::Arc;

use crate::checkpoint::{Checkpoint, QuantWeight, WeightFormat};
use crate::device::gemm::matmul_nt;
use crate::numerics::nvfp4::{self, Convention, QuantHealth};
use crate::numerics::{e2m1, e4m3, fp8_block, swizzle};
use crate::Result;

pub mod engine;
pub mod faults;
pub mod fused;
pub mod linears;
pub mod profile;

use faults::{Fault, FaultKind};
pub use linears::{CpuLinears, FusedExperts, LinearCtx, Linears, Observed};
pub use profile::{
    ActQuant, Epilogue, ExactAct, ExactRecipe, PathKind, Profile, Recipe, WeightOperand,
};

/// The overrides among (weight base, override) pairs that apply to weight `base`, in order.
pub fn overrides_of(overrides: &[(String, Override)], base: &str) -> Vec<Override> {
    overrides
        .iter()
        .filter(|(b, _)| b == base)
        .map(|(_, o)| o.clone())
        .collect()
}

/// A scale value forced by bisect's hypotheses (applied after the loader's reading).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub enum Override {
    /// Encode multiplier of the activation (g_x); alpha follows consistently.
    InputEncode(f32),
    /// Weight decode multiplier (d_w); alpha follows consistently.
    WeightDecode(f32),
    /// GEMM alpha alone.
    Alpha(f32),
    /// Swap the nibbles back / re-read scales linear / unshift rows (layout repairs).
    NibbleSwap,
    Unswizzle,
    UnshiftRows,
    /// gpt-oss's `w13` rows re-ordered after the loader's reading (`faults::interleave` /
    /// `faults::deinterleave`), and blocks decoded with their stored scales (MXFP4 `_scales`:
    /// `faults::fused_expert_reading`; ModelOpt NVFP4's underscore keys `_weight_scale`,
    /// `_weight_scale_2`, `_input_scale`: [`nvfp4_scale_layout`], [`nvfp4_params_of`]).
    InterleaveGateUp,
    DeinterleaveGateUp,
    StoredBlockScales,
    /// FP8 1×128 activations quantized with the power-of-two scale the kernel keeps (repairs
    /// `non-pow2-ue8m0`), and an FP8 block weight's scales applied once (repairs `double-scale`).
    Pow2ActScale,
    SingleBlockScale,
    /// The experts' SwiGLU with the config's clamp (repairs `swiglu-unclamped`).
    SwigluClamp,
}

/// How the served path turned the stored NVFP4 fields into kernel parameters; reported by bisect.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Nvfp4Params {
    /// activation encode scale the kernel multiplies by (vLLM `input_global_scale_inv`)
    pub g_x: f32,
    /// weight decode scale (vLLM `weight_global_scale` after loading)
    pub d_w: f32,
    /// GEMM epilogue alpha (vLLM `alpha`)
    pub alpha: f32,
}

impl Nvfp4Params {
    /// Apply one of bisect's scalar hypotheses; alpha follows the replaced scale consistently.
    /// Layout overrides do not touch the scalars.
    pub fn apply(&mut self, o: &Override) {
        match *o {
            Override::InputEncode(g) => {
                self.alpha = self.alpha * self.g_x / g;
                self.g_x = g;
            }
            Override::WeightDecode(d) => {
                self.alpha = self.alpha / self.d_w * d;
                self.d_w = d;
            }
            Override::Alpha(a) => self.alpha = a,
            _ => {}
        }
    }
}

/// A weight prepared for the served GEMM. The decoded arrays are shared (`Arc`): bisect's
/// scalar hypotheses re-use them for every evaluation instead of copying gigabytes of experts.
pub enum ServedWeight {
    /// BF16/F16/F32 weight: BF16 GEMM, f32 output (no rounding inside the linear).
    Dense { w: Arc<Vec<f32>> },
    /// FP8 block / MXFP4: exact dequantized weight, the activation the family's engines give it
    /// under the profile (`profile::ExactRecipe`), BF16 output.
    Fp8Act {
        w: Arc<Vec<f32>>,
        non_pow2_act: bool,
        recipe: ExactRecipe,
    },
    /// NVFP4: `wq = e2m1 · s_w` (no tensor scale) plus the loader's scalars.
    Nvfp4 { wq: Arc<Vec<f32>>, p: Nvfp4Params },
}

impl ServedWeight {
    /// Rows `r0..r0+n` of a weight with `k` inputs (one group of a grouped projection).
    pub fn rows(&self, r0: usize, n: usize, k: usize) -> ServedWeight {
        let sl = |w: &Arc<Vec<f32>>| Arc::new(w[r0 * k..(r0 + n) * k].to_vec());
        match self {
            ServedWeight::Dense { w } => ServedWeight::Dense { w: sl(w) },
            ServedWeight::Fp8Act {
                w,
                non_pow2_act,
                recipe,
            } => ServedWeight::Fp8Act {
                w: sl(w),
                non_pow2_act: *non_pow2_act,
                recipe: *recipe,
            },
            ServedWeight::Nvfp4 { wq, p } => ServedWeight::Nvfp4 { wq: sl(wq), p: *p },
        }
    }
}

/// What one served linear observed (for the op's health counters).
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct LinearObs {
    pub health: Option<QuantHealth>,
    /// amax of the activation over the amax the static scale was calibrated for (2688 / g_x).
    pub act_amax_over_calib: Option<f64>,
    pub params: Option<Nvfp4Params>,
}

/// The loader's reading of the stored NVFP4 scalars (vLLM `process_weights_after_loading`, docs/NVFP4.md §3.5),
/// including the one tensor scale a fused engine keeps for a fused group ([`fused`]: the max over a
/// merged dense linear, the gate's weight scale for a routed expert's `w13`; §3.4), then loader faults.
pub fn resolve_nvfp4(
    ckpt: &Checkpoint,
    qw: &QuantWeight,
    conv: Convention,
    weight_global: f32,
    input_global: Option<f32>,
    fuse_pairs: bool,
    faults: &[&Fault],
) -> Nvfp4Params {
    resolve_nvfp4_named(
        ckpt,
        &qw.canonical,
        conv,
        weight_global,
        input_global,
        fuse_pairs,
        faults,
    )
}

/// [`resolve_nvfp4`] for a weight known by its canonical base name.
pub fn resolve_nvfp4_named(
    ckpt: &Checkpoint,
    canonical: &str,
    conv: Convention,
    weight_global: f32,
    input_global: Option<f32>,
    fuse_pairs: bool,
    faults: &[&Fault],
) -> Nvfp4Params {
    let (mut wg, mut ig) = if fuse_pairs {
        // the engine keeps one scale per fused weight (`fused`'s table and rules)
        fused::merged_scalars(ckpt, canonical, conv, weight_global, input_global)
    } else {
        (weight_global, input_global.unwrap_or(0.0))
    };
    let has = |k: FaultKind| faults.iter().any(|f| f.kind == k);
    if has(FaultKind::MissingBlockScales) {
        // the scale keys never loaded: the engine's parameters keep their initial 1.0
        (wg, ig) = (1.0, 1.0);
    }
    if has(FaultKind::ZeroInputScale) || has(FaultKind::MissingInputScale) {
        ig = 0.0;
    }
    if has(FaultKind::NanInputScale) {
        ig = f32::NAN;
    }
    let (mut g_x, mut d_w) = match conv {
        Convention::CompressedTensors => (ig, 1.0 / wg),
        Convention::ModelOpt => (1.0 / ig, wg),
    };
    if has(FaultKind::InvertedInputScale) {
        g_x = 1.0 / g_x;
    }
    if has(FaultKind::InvertedWeightScale) {
        d_w = 1.0 / d_w;
    }
    if has(FaultKind::InputAmaxX64) {
        g_x *= 64.0;
    }
    if has(FaultKind::W13ScaleMismatch) && canonical.ends_with(".w3") {
        d_w *= 1.6;
    }
    let mut alpha = match conv {
        // CT: alpha = input_global_scale (=1/g_x) · weight_global_scale (=1/g_w), fp32 product of reciprocals
        Convention::CompressedTensors => (1.0 / g_x) * d_w,
        Convention::ModelOpt => (1.0 / g_x) * d_w,
    };
    if has(FaultKind::DoubleScale) {
        alpha *= d_w;
    }
    if has(FaultKind::MissingAlpha) {
        alpha = 1.0;
    }
    if has(FaultKind::E4m3ScaleUnbiased) {
        // E4M3's exponent (bias 7) put in BF16's field (bias 127) as is: every block ×2^-120
        alpha *= (-120f32).exp2();
    }
    Nvfp4Params { g_x, d_w, alpha }
}

/// The block-scale bytes (linear [rows, cols/16]) and the nibble order the served path decodes an
/// NVFP4 weight with, given the stored scale bytes, the loader's layout faults and bisect's layout
/// repairs: every layout fault and repair is a rearrangement of the scale bytes or the nibble order,
/// so a backend that holds the packed bytes needs only these (the CUDA backend uploads them).
pub fn nvfp4_scale_layout(
    scales: &[u8],
    rows: usize,
    cols: usize,
    faults: &[&Fault],
    overrides: &[Override],
) -> (Vec<u8>, bool) {
    let has = |k: FaultKind| faults.iter().any(|f| f.kind == k);
    let ov = |o: &Override| overrides.contains(o);
    let nb = cols / nvfp4::BLOCK;
    let mut sc: Vec<u8> = scales.to_vec();
    if has(FaultKind::MissingBlockScales) && !ov(&Override::StoredBlockScales) {
        // `_weight_scale` never loaded: every block decodes with scale 1.0 (E4M3 0x38)
        sc.iter_mut().for_each(|b| *b = 0x38);
    }
    if has(FaultKind::SwizzledScales) {
        // the engine believes the linear bytes are swizzled and unswizzles them
        let padded_rows = rows.div_ceil(128) * 128;
        let padded_cols = nb.div_ceil(4) * 4;
        let mut buf = vec![0u8; padded_rows * padded_cols];
        let n = buf.len().min(sc.len());
        buf[..n].copy_from_slice(&sc[..n]);
        sc = swizzle::unswizzle_128x4(&buf, rows, nb);
    }
    if ov(&Override::Unswizzle) {
        // the stored bytes are swizzled: read them through the swizzled layout
        let padded_rows = rows.div_ceil(128) * 128;
        let padded_cols = nb.div_ceil(4) * 4;
        let mut buf = vec![0u8; padded_rows * padded_cols];
        let n = buf.len().min(sc.len());
        buf[..n].copy_from_slice(&sc[..n]);
        sc = swizzle::unswizzle_128x4(&buf, rows, nb);
    }
    if has(FaultKind::ShiftedScaleRows) && rows > 1 {
        sc.copy_within(nb.., 0);
    }
    if ov(&Override::UnshiftRows) && rows > 1 {
        sc.copy_within(..(rows - 1) * nb, nb);
    }
    if has(FaultKind::NanBlockScale) && !sc.is_empty() {
        sc[0] = 0x7F;
    }
    let swap = has(FaultKind::NibbleSwap) ^ ov(&Override::NibbleSwap);
    (sc, swap)
}

/// The loader's NVFP4 scalars of a weight known by its metadata, with bisect's hypotheses on it
/// applied in order (what `prepare` puts in `ServedWeight::Nvfp4`; a missing tensor scale reads
/// as NaN, as the decoded weight carries it).
pub fn nvfp4_params_of(
    ckpt: &Checkpoint,
    meta: &crate::checkpoint::WeightMeta,
    conv: Convention,
    fuse_pairs: bool,
    faults: &[&Fault],
    overrides: &[Override],
) -> Nvfp4Params {
    let mut p = resolve_nvfp4_named(
        ckpt,
        &meta.canonical,
        conv,
        meta.weight_global.unwrap_or(f32::NAN),
        meta.input_global,
        fuse_pairs,
        &read_faults(faults, overrides),
    );
    for o in overrides {
        p.apply(o);
    }
    p
}

/// The loader faults a reading still has once bisect's repairs apply: re-reading the stored
/// block scales (ModelOpt's underscore keys) restores the tensor scales with them.
fn read_faults<'a>(faults: &[&'a Fault], overrides: &[Override]) -> Vec<&'a Fault> {
    let reread = overrides.contains(&Override::StoredBlockScales);
    faults
        .iter()
        .filter(|f| !(reread && f.kind == FaultKind::MissingBlockScales))
        .copied()
        .collect()
}

/// The FP8-activation loader faults a reading of a weight stored as `scheme` keeps once bisect's
/// repairs apply: (the activation scale divided out as an f32 but packed as its exponent alone,
/// the block scales applied twice — FP8 block's f32 multipliers only).
pub fn fp8_act_faults(
    scheme: crate::checkpoint::Scheme,
    faults: &[&Fault],
    overrides: &[Override],
) -> (bool, bool) {
    let has = |k: FaultKind| faults.iter().any(|f| f.kind == k);
    (
        has(FaultKind::NonPow2Ue8m0) && !overrides.contains(&Override::Pow2ActScale),
        has(FaultKind::DoubleScale)
            && scheme == crate::checkpoint::Scheme::Fp8Block
            && !overrides.contains(&Override::SingleBlockScale),
    )
}

/// True when a loader fault or a hypothesis rearranges an NVFP4 weight's block scales (the served
/// reading then needs [`nvfp4_scale_layout`]; otherwise it decodes the stored bytes).
pub fn nvfp4_layout_changed(faults: &[&Fault], overrides: &[Override]) -> bool {
    faults.iter().any(|f| is_layout_fault(f.kind)) || overrides.iter().any(is_layout_repair)
}

/// The loader faults that change an NVFP4 weight's block-scale bytes ([`nvfp4_scale_layout`]).
pub fn is_layout_fault(k: FaultKind) -> bool {
    matches!(
        k,
        FaultKind::SwizzledScales
            | FaultKind::ShiftedScaleRows
            | FaultKind::NanBlockScale
            | FaultKind::MissingBlockScales
    )
}

/// The repairs that change them back ([`nvfp4_scale_layout`]).
pub fn is_layout_repair(o: &Override) -> bool {
    matches!(
        o,
        Override::Unswizzle | Override::UnshiftRows | Override::StoredBlockScales
    )
}

/// How a backend that keeps an NVFP4 weight's stored bytes serves it under these loader faults and
/// hypotheses, without decoding it: the block-scale bytes to decode with (None: the stored ones;
/// read from `stored_scales()` only when a layout fault or repair applies), the nibble order, and
/// the scalars. Decoding `e2m1 · e4m3(scale)` with these equals `prepare`'s `wq` bit for bit.
pub fn nvfp4_served_bytes(
    ckpt: &Checkpoint,
    meta: &crate::checkpoint::WeightMeta,
    conv: Convention,
    fuse_pairs: bool,
    faults: &[&Fault],
    overrides: &[Override],
    stored_scales: impl FnOnce() -> Result<Vec<u8>>,
) -> Result<(Option<Vec<u8>>, bool, Nvfp4Params)> {
    let p = nvfp4_params_of(ckpt, meta, conv, fuse_pairs, faults, overrides);
    if nvfp4_layout_changed(faults, overrides) {
        let stored = stored_scales()?;
        let (sc, swap) = nvfp4_scale_layout(
            &stored,
            meta.out_features,
            meta.in_features,
            faults,
            overrides,
        );
        Ok((Some(sc), swap, p))
    } else {
        let swap = faults.iter().any(|f| f.kind == FaultKind::NibbleSwap)
            ^ overrides.contains(&Override::NibbleSwap);
        Ok((None, swap, p))
    }
}

/// Decode `e2m1 · s_w` for an NVFP4 weight with the loader's layout faults or bisect's repairs applied.
fn nvfp4_wq(
    packed: &[u8],
    scales: &[u8],
    rows: usize,
    cols: usize,
    faults: &[&Fault],
    overrides: &[Override],
) -> Vec<f32> {
    let nb = cols / nvfp4::BLOCK;
    let (sc, swap) = nvfp4_scale_layout(scales, rows, cols, faults, overrides);
    let mut out = vec![0f32; rows * cols];
    for r in 0..rows {
        for b in 0..nb {
            let s = e4m3::decode(sc[r * nb + b]);
            let base = r * cols + b * nvfp4::BLOCK;
            for i in 0..nvfp4::BLOCK / 2 {
                let (mut lo, mut hi) = e2m1::unpack(packed[base / 2 + i]);
                if swap {
                    std::mem::swap(&mut lo, &mut hi);
                }
                out[base + 2 * i] = e2m1::decode(lo) * s;
                out[base + 2 * i + 1] = e2m1::decode(hi) * s;
            }
        }
    }
    out
}

/// Prepare a weight for the served GEMM. `dequant_f32` is the weight's dequantized values, which
/// an NVFP4 weight does not read (its operand is decoded from the stored codes).
pub fn prepare(
    ckpt: &Checkpoint,
    qw: &QuantWeight,
    dequant_f32: &[f32],
    fuse_pairs: bool,
    faults: &[&Fault],
    overrides: &[Override],
) -> Result<ServedWeight> {
    use crate::checkpoint::formats::Served;
    let served = qw.format.scheme().spec().served;
    // gpt-oss's fused-expert loader faults and their repairs change the decoded values (an NVFP4
    // weight re-orders its decoded operand below)
    let read = (served != Served::Nvfp4)
        .then(|| faults::fused_expert_reading(qw, dequant_f32, faults, overrides))
        .flatten();
    let dequant_f32 = read.as_deref().unwrap_or(dequant_f32);
    Ok(match (&qw.format, served) {
        (_, Served::Dense) => ServedWeight::Dense {
            w: Arc::new(
                dequant_f32
                    .iter()
                    .map(|&v| crate::numerics::bf16::round(v))
                    .collect(),
            ),
        },
        (_, Served::Fp8Act) => {
            let mut w = dequant_f32.to_vec();
            let (non_pow2_act, double_scale) =
                fp8_act_faults(qw.format.scheme(), faults, overrides);
            if double_scale {
                if let WeightFormat::Fp8Block { scales, block, .. } = &qw.format {
                    let (rows, cols) = (qw.out_features, qw.in_features);
                    let sc = cols.div_ceil(block[1]);
                    for r in 0..rows {
                        for c in 0..cols {
                            w[r * cols + c] *= scales[(r / block[0]) * sc + c / block[1]];
                        }
                    }
                }
            }
            ServedWeight::Fp8Act {
                w: Arc::new(w),
                non_pow2_act,
                recipe: ExactRecipe::in_checkpoint(ckpt, qw.format.scheme()),
            }
        }
        (
            WeightFormat::Nvfp4 {
                packed,
                scales,
                convention,
                weight_global,
                input_global,
            },
            _,
        ) => {
            let mut p = resolve_nvfp4(
                ckpt,
                qw,
                *convention,
                *weight_global,
                *input_global,
                fuse_pairs,
                &read_faults(faults, overrides),
            );
            for o in overrides {
                p.apply(o);
            }
            let wq = nvfp4_wq(
                packed,
                scales,
                qw.out_features,
                qw.in_features,
                faults,
                overrides,
            );
            // a w13 whose rows the loader re-orders: its rows move with their block scales
            let wq = faults::reorder_w13(&qw.canonical, qw.out_features, faults, overrides, &wq)
                .unwrap_or(wq);
            ServedWeight::Nvfp4 {
                wq: Arc::new(wq),
                p,
            }
        }
        (_, Served::Nvfp4) => {
            return Err(crate::Error::usage(format!(
                "internal: {} is served as NVFP4 but not stored as NVFP4",
                qw.canonical
            )))
        }
    })
}

/// A grouped projection over x [rows, G, k]: `f(g, x_g)` computes group g's [rows, r] output from its
/// [rows, k] input; the results are interleaved back into [rows, G, r].
pub fn grouped(
    x: &[f32],
    rows: usize,
    groups: usize,
    k: usize,
    r: usize,
    mut f: impl FnMut(usize, &[f32]) -> Result<Vec<f32>>,
) -> Result<Vec<f32>> {
    let mut out = vec![0f32; rows * groups * r];
    let mut xg = Vec::with_capacity(rows * k);
    for g in 0..groups {
        xg.clear();
        for t in 0..rows {
            xg.extend_from_slice(&x[(t * groups + g) * k..(t * groups + g + 1) * k]);
        }
        let yg = f(g, &xg)?;
        for t in 0..rows {
            out[(t * groups + g) * r..(t * groups + g + 1) * r]
                .copy_from_slice(&yg[t * r..(t + 1) * r]);
        }
    }
    Ok(out)
}

/// Run the served linear: x [m, k] (BF16 values) → y [m, n].
pub fn apply(
    sw: &ServedWeight,
    profile: Profile,
    x: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> (Vec<f32>, LinearObs) {
    let bf = crate::numerics::bf16::round;
    match sw {
        ServedWeight::Dense { w } => (matmul_nt(x, w, m, k, n), LinearObs::default()),
        ServedWeight::Fp8Act {
            w,
            non_pow2_act,
            recipe,
        } => {
            let xq: std::borrow::Cow<[f32]> = match profile.exact_act(*recipe) {
                ExactAct::Fp8x128 if *non_pow2_act => fake_quant_fp8_non_pow2(x, m, k).into(),
                ExactAct::Fp8x128 => {
                    fp8_block::fake_quant_act_1x128(x, m, k, fp8_block::ActScale::DeepSeekPow2)
                        .into()
                }
                ExactAct::Mxfp8 => fp8_block::fake_quant_act_mxfp8(x, m, k).into(),
                ExactAct::Bf16 => x.into(),
            };
            let mut y = matmul_nt(&xq, w, m, k, n);
            y.iter_mut().for_each(|v| *v = bf(*v));
            (y, LinearObs::default())
        }
        ServedWeight::Nvfp4 { wq, p } => {
            let amax = x.iter().fold(0f32, |a, v| a.max(v.abs())) as f64;
            let calib = 2688.0 / p.g_x as f64;
            let ratio = if calib.is_finite() && calib > 0.0 {
                Some(amax / calib)
            } else {
                None
            };
            let mut obs = LinearObs {
                act_amax_over_calib: ratio,
                params: Some(*p),
                ..Default::default()
            };
            let r = profile.recipe();
            let xa: std::borrow::Cow<[f32]> = match r.act {
                ActQuant::Bf16 => x.into(),
                ActQuant::Nvfp4Bf16 => {
                    let (xh, h) = nvfp4::fake_quant_activation(x, m, k, p.g_x);
                    obs.health = Some(h);
                    xh.into_iter().map(bf).collect::<Vec<f32>>().into()
                }
                ActQuant::Nvfp4Codes => {
                    let (_, h) = nvfp4::fake_quant_activation(x, m, k, p.g_x);
                    obs.health = Some(h);
                    let act = nvfp4::quantize_activation(x, m, k, p.g_x);
                    let nb = k / nvfp4::BLOCK;
                    let mut xq = vec![0f32; m * k];
                    for r in 0..m {
                        for b in 0..nb {
                            let s = e4m3::decode(act.scales[r * nb + b]);
                            let base = r * k + b * nvfp4::BLOCK;
                            for i in 0..nvfp4::BLOCK / 2 {
                                let (lo, hi) = e2m1::unpack(act.packed[base / 2 + i]);
                                xq[base + 2 * i] = e2m1::decode(lo) * s;
                                xq[base + 2 * i + 1] = e2m1::decode(hi) * s;
                            }
                        }
                    }
                    xq.into()
                }
            };
            let wa: std::borrow::Cow<[f32]> = match r.weight {
                WeightOperand::E2m1Scaled => wq[..].into(),
                WeightOperand::Bf16Dequantized => wq
                    .iter()
                    .map(|&v| bf(v * p.d_w))
                    .collect::<Vec<f32>>()
                    .into(),
            };
            let mut y = matmul_nt(&xa, &wa, m, k, n);
            match r.epilogue {
                Epilogue::Round => y.iter_mut().for_each(|v| *v = bf(*v)),
                e => {
                    let mul = e.multiplier(p);
                    y.iter_mut().for_each(|v| *v = bf(*v * mul));
                }
            }
            (y, obs)
        }
    }
}

/// FP8 1×128 activation quantization whose power-of-two scale was packed from an f32 scale by keeping
/// only its exponent bits while the values were divided by the full f32 scale (sglang #25704's class).
pub fn fake_quant_fp8_non_pow2(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let mut out = vec![0f32; m * k];
    for r in 0..m {
        for g0 in (0..k).step_by(128) {
            let g1 = (g0 + 128).min(k);
            let row = &x[r * k + g0..r * k + g1];
            let amax = row.iter().fold(0f32, |a, v| a.max(v.abs())).max(1e-4);
            let s = amax / 448.0;
            let s_pow2 = f32::from_bits(s.to_bits() & 0xFF80_0000); // exponent bits only
            for (i, &v) in row.iter().enumerate() {
                let q = e4m3::decode(e4m3::encode_satfinite(v / s));
                out[r * k + g0 + i] = q * s_pow2;
            }
        }
    }
    out
}
