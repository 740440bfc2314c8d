//! Linear weights into checkpoint tensors, per scheme, with the producer-exact encoders of
//! `numerics`, and the planted faults of `served::faults` applied to the bytes and scales.

use crate::checkpoint::{Dtype, Naming};
use crate::numerics::fp8_block::{self, Fp8ScaleFmt};
use crate::numerics::mxfp4::{self, Mxfp4Rule};
use crate::numerics::nvfp4::{self, NvFp4Quant};
use rayon::prelude::*;

use crate::numerics::{swizzle, ue8m0};
use crate::served::faults::{Fault, FaultKind};
use crate::{Error, Result};

use super::plan::{role, Role, WScheme};

/// One tensor to write, under its canonical name (leaf included).
#[derive(Clone, Debug, PartialEq)]
pub struct RawT {
    /// Canonical name, or the raw name itself when `raw` (HF fused expert tensors).
    pub name: String,
    pub raw: bool,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

/// A linear weight with its generated values and its calibrated input amax.
pub struct LinIn<'a> {
    pub base: &'a str,
    pub w: &'a [f32],
    pub out: usize,
    pub inp: usize,
    pub act_amax: f32,
}

/// BF16 bytes of finite values (every value synth writes is finite).
pub fn bf16_bytes(v: &[f32]) -> Vec<u8> {
    let mut out = vec![0u8; v.len() * 2];
    out.par_chunks_mut(1 << 20)
        .zip(v.par_chunks(1 << 19))
        .for_each(|(o, x)| {
            for (o, &x) in o.chunks_exact_mut(2).zip(x) {
                o.copy_from_slice(&super::gen::bf16_bits(x).to_le_bytes());
            }
        });
    out
}

pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

pub fn i64_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|&x| (x as i64).to_le_bytes()).collect()
}

fn usage(f: FaultKind, base: &str, scheme: WScheme, why: &str) -> Error {
    Error::usage(format!(
        "fault {}@…: does not apply to `{base}` ({} weight): {why}",
        f.name(),
        scheme.name()
    ))
}

/// Is `kind` plantable into weight `base` stored as `scheme`? `Ok(false)` means the target
/// covers the weight but the fault leaves it alone (w13-scale-mismatch on w1/w2).
pub fn applies(kind: FaultKind, base: &str, scheme: WScheme) -> Result<bool> {
    use FaultKind::*;
    let nv = scheme.is_nvfp4();
    let ok = match kind {
        MissingAlpha => {
            return Err(Error::usage(
                "fault missing-alpha is a loader-only fault: a checkpoint has no alpha tensor \
                 (alpha = d_x·d_w is computed at load time); use `run --loader-fault missing-alpha@TARGET`",
            ))
        }
        SwigluUnclamped => {
            return Err(Error::usage(
                "fault swiglu-unclamped is an engine-only fault: a checkpoint has no clamp to leave \
                 out (the limit is config.json's `swiglu_limit`, passed to the MoE kernel at load); \
                 use `run --loader-fault swiglu-unclamped@Ln.ffn.experts`",
            ))
        }
        Ue8m0Requantized | E8m0BiasOffByOne | E4m3ScaleUnbiased | Bf16CorrectionBias
        | RoutedScalingDropped | RoutedScalingDoubled | SinksDropped => {
            return Err(Error::usage(format!(
                "fault {} is a loader/engine fault (docs/CATALOGUE-2026.md): the checkpoint is right, \
                 the engine reads it wrong; use `run --loader-fault {}@TARGET`",
                kind.name(),
                kind.name()
            )))
        }
        InvertedInputScale | InputAmaxX64 | ZeroInputScale | MissingInputScale | NanInputScale
        | InfInputScale | DoubleScale => nv,
        InvertedWeightScale => nv || matches!(scheme, WScheme::Fp8 | WScheme::Fp8F32),
        // parameter faults (`synth::family::plant_params`) leave every linear alone
        MissingCorrectionBias | SwappedQkNorm => return Ok(false),
        // planted where gpt-oss's experts are fused (`synth::family::gpt_oss::fuse`)
        GateUpDeinterleaved | GateUpInterleavedTwice | MissingBlockScales | MissingExpertBias
        | ZeroedExpertBias => {
            return Err(usage(
                kind,
                base,
                scheme,
                "it belongs to gpt-oss's fused experts (synth --family gpt-oss)",
            ))
        }
        NanBlockScale | ShiftedScaleRows => scheme != WScheme::Bf16,
        NibbleSwap | SwizzledScales => nv || scheme == WScheme::Mxfp4,
        NonPow2Ue8m0 => scheme == WScheme::Fp8,
        W13ScaleMismatch => {
            let r = role(base);
            if !matches!(r, Role::Expert(_) | Role::Shared(_)) || !nv {
                return Err(usage(
                    kind,
                    base,
                    scheme,
                    "needs the NVFP4 w1/w3 pair of an expert",
                ));
            }
            return Ok(matches!(r, Role::Expert(3) | Role::Shared(3)));
        }
    };
    if ok {
        Ok(true)
    } else {
        let why = match kind {
            NonPow2Ue8m0 => "needs an FP8 block weight with UE8M0 scales (DeepSeek-V3's FP8 release stores f32 scales, no UE8M0 claim to break)",
            NibbleSwap | SwizzledScales => "needs a packed FP4 weight (NVFP4 or MXFP4)",
            InvertedWeightScale => "needs an NVFP4 tensor scale or FP8 block scales",
            NanBlockScale | ShiftedScaleRows => "a BF16 weight has no block scales",
            _ => "needs an NVFP4 weight with a static activation scale",
        };
        Err(usage(kind, base, scheme, why))
    }
}

fn has(kinds: &[FaultKind], k: FaultKind) -> bool {
    kinds.contains(&k)
}

/// Rotate the rows of a row-major [rows, cols] byte matrix by one of `elem` bytes each.
fn shift_rows(b: &mut [u8], rows: usize, row_bytes: usize) {
    if rows > 1 {
        b[..rows * row_bytes].rotate_right(row_bytes);
    }
}

fn swap_nibbles(b: &mut [u8]) {
    for x in b {
        *x = x.rotate_left(4);
    }
}

/// Scale bytes [rows, cols] stored swizzled; the padded buffer keeps its padded shape.
fn swizzled(scales: &[u8], rows: usize, cols: usize) -> (Vec<u8>, Vec<usize>) {
    let (rp, cp) = swizzle::padded_128x4(rows, cols);
    (swizzle::swizzle_128x4(scales, rows, cols), vec![rp, cp])
}

/// Encode one group (members share an NVFP4 tensor scale, made from their largest |w|, or from
/// `shared_amax` when the scale spans more than the group: ModelOpt's one scale for all of a
/// gpt-oss projection's experts). `faults` are those of the run; each member takes the ones that
/// hit it.
pub fn encode_group(
    members: &[LinIn],
    scheme: WScheme,
    naming: Naming,
    faults: &[Fault],
    shared_amax: Option<f32>,
) -> Result<Vec<RawT>> {
    let mut out = Vec::new();
    let group_amax = shared_amax.unwrap_or_else(|| {
        members
            .iter()
            .map(|m| nvfp4::amax(m.w))
            .fold(0f32, f32::max)
    });
    for m in members {
        let mut kinds = Vec::new();
        // gpt-oss's fused-layout kinds are planted when its experts are fused
        let own = |f: &&Fault| f.hits(m.base) && !f.kind.is_fused_expert();
        for f in faults.iter().filter(own) {
            if applies(f.kind, m.base, scheme)? {
                kinds.push(f.kind);
            }
        }
        out.extend(encode_one(m, scheme, naming, group_amax, &kinds)?);
    }
    Ok(out)
}

fn encode_one(
    m: &LinIn,
    scheme: WScheme,
    naming: Naming,
    group_amax: f32,
    kinds: &[FaultKind],
) -> Result<Vec<RawT>> {
    use FaultKind::*;
    let (o, i, b) = (m.out, m.inp, m.base);
    let t = |leaf: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>| RawT {
        name: format!("{b}.{leaf}"),
        raw: false,
        dtype,
        shape,
        bytes,
    };
    Ok(match scheme {
        WScheme::Bf16 => vec![t("weight", Dtype::BF16, vec![o, i], bf16_bytes(m.w))],
        WScheme::Nvfp4Ct | WScheme::Nvfp4ModelOpt => {
            let ct = scheme == WScheme::Nvfp4Ct;
            let mut global = if ct {
                nvfp4::global_scale_ct(group_amax)
            } else {
                nvfp4::global_scale_modelopt(group_amax)
            };
            if has(kinds, W13ScaleMismatch) {
                global *= 1.6;
            }
            // double-scale: nibbles and block scales made with the tensor scale applied twice.
            let q_global = if has(kinds, DoubleScale) {
                global * global
            } else {
                global
            };
            let NvFp4Quant {
                mut packed,
                mut scales,
                ..
            } = if ct {
                nvfp4::quantize_ct_with_global(m.w, o, i, q_global)
            } else {
                nvfp4::quantize_modelopt_with_global(m.w, o, i, q_global)
            };
            let stored_global = if has(kinds, InvertedWeightScale) {
                1.0 / global
            } else {
                global
            };
            let nb = i / nvfp4::BLOCK;
            let sshape = plant_packed_faults(kinds, &mut packed, &mut scales, o, nb, 0x7F);
            let mut amax_x = m.act_amax;
            if has(kinds, InputAmaxX64) {
                amax_x /= 64.0;
            }
            let mut act = if ct {
                nvfp4::global_scale_ct(amax_x)
            } else {
                nvfp4::global_scale_modelopt(amax_x)
            };
            if has(kinds, InvertedInputScale) {
                act = 1.0 / act;
            }
            if has(kinds, ZeroInputScale) {
                act = 0.0;
            }
            if has(kinds, NanInputScale) {
                act = f32::NAN;
            }
            if has(kinds, InfInputScale) {
                act = f32::INFINITY;
            }
            let (wl, gl, il, sc_shape) = if ct {
                (
                    "weight_packed",
                    "weight_global_scale",
                    "input_global_scale",
                    vec![1],
                )
            } else {
                ("weight", "weight_scale_2", "input_scale", vec![])
            };
            let mut v = vec![
                t(wl, Dtype::U8, vec![o, i / 2], packed),
                t("weight_scale", Dtype::F8_E4M3, sshape, scales),
                t(
                    gl,
                    Dtype::F32,
                    sc_shape.clone(),
                    stored_global.to_le_bytes().to_vec(),
                ),
            ];
            if !has(kinds, MissingInputScale) {
                v.push(t(il, Dtype::F32, sc_shape, act.to_le_bytes().to_vec()));
            }
            v
        }
        WScheme::Fp8 | WScheme::Fp8F32 => {
            let (bm, bn) = (128, 128);
            let fmt = if scheme == WScheme::Fp8F32 || has(kinds, NonPow2Ue8m0) {
                Fp8ScaleFmt::F32
            } else {
                Fp8ScaleFmt::Ue8m0
            };
            let (q, mut s) = fp8_block::quantize_weight(m.w, o, i, bm, bn, fmt);
            let grid = vec![o.div_ceil(bm), i.div_ceil(bn)];
            if has(kinds, InvertedWeightScale) {
                s.iter_mut().for_each(|x| *x = 1.0 / *x);
            }
            // The official release stores `.scale` as E8M0 bytes; a transformers-named export
            // keeps FP8's `weight_scale_inv` as F32 (values still powers of two).
            let f32_scales = fmt == Fp8ScaleFmt::F32 || naming == Naming::Hf;
            let (mut sb, sdt) = if f32_scales {
                (f32_bytes(&s), Dtype::F32)
            } else {
                let b: Vec<u8> = s
                    .iter()
                    .map(|&x| ue8m0::encode(x, ue8m0::Ue8m0Rounding::Floor))
                    .collect();
                (b, Dtype::F8_E8M0)
            };
            let es = if f32_scales { 4 } else { 1 };
            if has(kinds, NanBlockScale) {
                if f32_scales {
                    sb[..4].copy_from_slice(&f32::NAN.to_le_bytes());
                } else {
                    sb[0] = 0xFF;
                }
            }
            if has(kinds, ShiftedScaleRows) {
                if grid[0] < 2 {
                    return Err(usage(
                        ShiftedScaleRows,
                        b,
                        WScheme::Fp8,
                        "the scale grid has a single row",
                    ));
                }
                shift_rows(&mut sb, grid[0], grid[1] * es);
            }
            let leaf = if naming == Naming::Hf {
                "weight_scale_inv"
            } else {
                "scale"
            };
            vec![
                t("weight", Dtype::F8_E4M3, vec![o, i], q),
                t(leaf, sdt, grid, sb),
            ]
        }
        WScheme::Table(s) => {
            let spec = s.spec();
            let (Some(y), Some(d)) = (&spec.synth, spec.decode) else {
                return Err(Error::usage(format!(
                    "synth: format {} has no encoder",
                    spec.label
                )));
            };
            let mut v: Vec<RawT> = (y.encode)(m.w, o, i)
                .into_iter()
                .map(|st| t(st.leaf, st.dtype, st.shape, st.bytes))
                .collect();
            // the block-scale faults every table format has, planted into its scale tensor
            let is_scale = |r: &RawT| {
                spec.tensors
                    .scale_leaves
                    .iter()
                    .any(|l| r.name.ends_with(&format!(".{l}")))
            };
            if let Some(sc) = v.iter_mut().find(|r| is_scale(r)) {
                if has(kinds, NanBlockScale) && !sc.bytes.is_empty() {
                    sc.bytes[0] = d.scale.nan_byte();
                }
                if has(kinds, ShiftedScaleRows) {
                    let rb = sc.shape.get(1).copied().unwrap_or(0);
                    shift_rows(&mut sc.bytes, o, rb);
                }
            }
            v
        }
        WScheme::Mxfp4 => {
            // DeepSeek's FP4 quantisation rounds the block scale up (never clips): 2^ceil(log2(amax/6)).
            let (mut packed, mut scales) = mxfp4::quantize(m.w, o, i, Mxfp4Rule::Ceil);
            let nb = i / mxfp4::BLOCK;
            let sshape = plant_packed_faults(kinds, &mut packed, &mut scales, o, nb, 0xFF);
            let leaf = if naming == Naming::Hf {
                "weight_scale"
            } else {
                "scale"
            };
            vec![
                t("weight", Dtype::I8, vec![o, i / 2], packed),
                t(leaf, Dtype::F8_E8M0, sshape, scales),
            ]
        }
    })
}

/// The layout faults shared by the two packed 4-bit formats: a NaN block-scale byte (`nan_byte` in the
/// format's scale encoding), scale rows shifted by one, scales stored swizzled, nibbles swapped.
/// Returns the stored shape of the block scales (swizzling may pad it).
fn plant_packed_faults(
    kinds: &[FaultKind],
    packed: &mut [u8],
    scales: &mut Vec<u8>,
    o: usize,
    nb: usize,
    nan_byte: u8,
) -> Vec<usize> {
    use FaultKind::*;
    let mut sshape = vec![o, nb];
    if has(kinds, NanBlockScale) {
        scales[0] = nan_byte;
    }
    if has(kinds, ShiftedScaleRows) {
        shift_rows(scales, o, nb);
    }
    if has(kinds, SwizzledScales) {
        let (s, sh) = swizzled(scales, o, nb);
        *scales = s;
        sshape = sh;
    }
    if has(kinds, NibbleSwap) {
        swap_nibbles(packed);
    }
    sshape
}
