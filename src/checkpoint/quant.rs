//! Quantisation scheme of each linear weight, decided from tensor names and dtypes (with the
//! quantization config for block sizes), and the one `QuantWeight` type every consumer uses.
//!
//! Detection is done on headers alone (`weight_meta`), so `inspect` and `lint` can describe a
//! 256-expert layer without reading one packed byte; `weight` then reads what the meta names.

use std::path::PathBuf;

use serde::Serialize;

use super::{convert, Checkpoint, Dtype, TensorInfo};
use crate::model::ModelConfig;
use crate::numerics::nvfp4::Convention;
use crate::numerics::{e4m3, fp8_block, mxfp4, nvfp4, ue8m0};
use crate::{Error, Result, Tensor};

/// How an FP8 block weight stores its scale multipliers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Fp8ScaleKind {
    /// `weight_scale_inv` as f32 (DeepSeek-V3 style).
    F32,
    /// `.scale` as UE8M0 power-of-two exponents (official V4).
    Ue8m0,
}

pub use super::formats::Scheme;

/// Raw (checkpoint) names of the tensors a weight is made of.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct WeightTensors {
    pub weight: String,
    pub block_scale: Option<String>,
    pub global_scale: Option<String>,
    pub input_scale: Option<String>,
}

/// Everything about a weight that the headers and the scalar scales say.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct WeightMeta {
    pub canonical: String,
    pub out_features: usize,
    pub in_features: usize,
    pub scheme: Scheme,
    pub weight_dtype: Dtype,
    pub tensors: WeightTensors,
    pub file: PathBuf,
    /// NVFP4 only.
    pub convention: Option<Convention>,
    /// NVFP4 weight tensor scale as stored (CT g_w or ModelOpt d_w).
    pub weight_global: Option<f32>,
    /// NVFP4 activation tensor scale as stored (CT g_x or ModelOpt d_x); None when absent.
    pub input_global: Option<f32>,
    /// FP8 block size [rows, cols].
    pub block: Option<[usize; 2]>,
    pub block_scale_dtype: Option<Dtype>,
    pub fp8_scale_kind: Option<Fp8ScaleKind>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum WeightFormat {
    /// BF16/F16/F32, widened exactly.
    Dense {
        dtype: Dtype,
        values: Vec<f32>,
    },
    Fp8Block {
        bytes: Vec<u8>,
        /// Decoded multipliers, row-major [ceil(out/bm), ceil(in/bn)].
        scales: Vec<f32>,
        scale_kind: Fp8ScaleKind,
        /// Scale bytes as stored.
        scale_raw: Vec<u8>,
        block: [usize; 2],
    },
    Mxfp4 {
        packed: Vec<u8>,
        scales: Vec<u8>,
    },
    Nvfp4 {
        packed: Vec<u8>,
        /// E4M3 bytes, linear [out, in/16].
        scales: Vec<u8>,
        convention: Convention,
        /// As stored: CT g_w or ModelOpt d_w.
        weight_global: f32,
        /// As stored: CT g_x or ModelOpt d_x.
        input_global: Option<f32>,
    },
    /// A format read entirely through the format table (`formats::Tensors::generic`): byte
    /// codes and byte block scales, decoded as `scheme.spec().decode` says.
    Blocked {
        scheme: Scheme,
        codes: Vec<u8>,
        scales: Vec<u8>,
    },
}

/// Where a weight's tensors are: [`Checkpoint::weight_layout`].
pub struct WeightLayout {
    pub meta: WeightMeta,
    /// Canonical name of the data tensor (`….weight` or `….weight_packed`).
    pub weight: String,
    /// Canonical name of the block-scale tensor, when the scheme has one.
    pub scale: Option<String>,
}

/// A weight as stored, borrowed from the checkpoint's mmap ([`Checkpoint::weight_raw`]).
pub struct RawWeight<'a> {
    pub meta: WeightMeta,
    pub format: RawFormat<'a>,
}

/// [`WeightFormat`] with the large byte arrays borrowed instead of copied.
pub enum RawFormat<'a> {
    /// Raw little-endian elements of `dtype` (BF16/F16/F32).
    Dense {
        dtype: Dtype,
        bytes: std::borrow::Cow<'a, [u8]>,
    },
    Fp8Block {
        bytes: std::borrow::Cow<'a, [u8]>,
        scales: Vec<f32>,
        scale_kind: Fp8ScaleKind,
        scale_raw: std::borrow::Cow<'a, [u8]>,
        block: [usize; 2],
    },
    Mxfp4 {
        packed: std::borrow::Cow<'a, [u8]>,
        scales: std::borrow::Cow<'a, [u8]>,
    },
    Nvfp4 {
        packed: std::borrow::Cow<'a, [u8]>,
        scales: std::borrow::Cow<'a, [u8]>,
        convention: Convention,
        weight_global: f32,
        input_global: Option<f32>,
    },
    Blocked {
        scheme: Scheme,
        codes: std::borrow::Cow<'a, [u8]>,
        scales: std::borrow::Cow<'a, [u8]>,
    },
}

#[derive(Clone, Debug, PartialEq)]
pub struct QuantWeight {
    pub canonical: String,
    pub out_features: usize,
    pub in_features: usize,
    pub format: WeightFormat,
    pub tensors: WeightTensors,
    pub file: PathBuf,
}

impl WeightMeta {
    pub fn scheme_label(&self) -> &'static str {
        self.scheme.label(self.weight_dtype)
    }
}

fn len_err(w: &QuantWeight, what: &str, got: usize, want: usize) -> Error {
    Error::bad(
        &w.file,
        Some(&w.tensors.weight),
        format!(
            "{what} holds {got} bytes/values, {want} expected for [{}, {}]",
            w.out_features, w.in_features
        ),
    )
}

impl QuantWeight {
    /// f32 [out, in], in the producer's own op order (bit-exact with its dequantisation).
    pub fn dequantize(&self) -> Result<Tensor> {
        let (o, i) = (self.out_features, self.in_features);
        let n = o * i;
        let data = match &self.format {
            WeightFormat::Dense { values, .. } => {
                if values.len() != n {
                    return Err(len_err(self, "weight", values.len(), n));
                }
                values.clone()
            }
            WeightFormat::Fp8Block {
                bytes,
                scales,
                block,
                ..
            } => {
                let ns = o.div_ceil(block[0]) * i.div_ceil(block[1]);
                if bytes.len() != n {
                    return Err(len_err(self, "weight", bytes.len(), n));
                }
                if scales.len() != ns || block[0] == 0 || block[1] == 0 {
                    return Err(len_err(self, "block scale", scales.len(), ns));
                }
                fp8_block::dequantize(bytes, scales, o, i, block[0], block[1])
            }
            WeightFormat::Mxfp4 { packed, scales } => {
                if i % mxfp4::BLOCK != 0 || packed.len() != n / 2 {
                    return Err(len_err(self, "packed weight", packed.len(), n / 2));
                }
                if scales.len() != n / mxfp4::BLOCK {
                    return Err(len_err(self, "block scale", scales.len(), n / mxfp4::BLOCK));
                }
                mxfp4::dequantize(packed, scales, o, i)
            }
            WeightFormat::Nvfp4 {
                packed,
                scales,
                convention,
                weight_global,
                ..
            } => {
                if i % nvfp4::BLOCK != 0 || packed.len() != n / 2 {
                    return Err(len_err(self, "packed weight", packed.len(), n / 2));
                }
                if scales.len() != n / nvfp4::BLOCK {
                    return Err(len_err(self, "block scale", scales.len(), n / nvfp4::BLOCK));
                }
                nvfp4::dequantize(packed, scales, *weight_global, *convention, o, i)
            }
            WeightFormat::Blocked {
                scheme,
                codes,
                scales,
            } => {
                let spec = scheme.spec();
                let d = spec.decode.expect("a generic format decodes");
                let bn = match d.block {
                    super::formats::Block::Row(n) => n,
                    super::formats::Block::Grid => 0,
                };
                let nc = n / d.elem.per_byte();
                if bn == 0 || i % bn != 0 || i % d.elem.per_byte() != 0 || codes.len() != nc {
                    return Err(len_err(self, "weight", codes.len(), nc));
                }
                if scales.len() != n / bn {
                    return Err(len_err(self, "block scale", scales.len(), n / bn));
                }
                super::formats::decode_blocked(&d, codes, scales, o, i)
            }
        };
        Ok(Tensor::new(vec![o, i], data))
    }

    /// The scheme label: "bf16" (or "f16"/"f32" for other dense dtypes), "fp8-block", "mxfp4",
    /// "nvfp4-ct", "nvfp4-modelopt", "mxfp8", … (the table's `label`).
    pub fn scheme(&self) -> &'static str {
        match &self.format {
            WeightFormat::Dense { dtype, .. } => Scheme::Dense.label(*dtype),
            f => f.scheme().spec().label,
        }
    }

    pub fn is_quantized(&self) -> bool {
        !matches!(self.format, WeightFormat::Dense { .. })
    }
}

impl WeightFormat {
    /// The format's entry in the format table.
    pub fn scheme(&self) -> Scheme {
        match self {
            WeightFormat::Dense { .. } => Scheme::Dense,
            WeightFormat::Fp8Block { .. } => Scheme::Fp8Block,
            WeightFormat::Mxfp4 { .. } => Scheme::Mxfp4,
            WeightFormat::Nvfp4 {
                convention: Convention::CompressedTensors,
                ..
            } => Scheme::Nvfp4Ct,
            WeightFormat::Nvfp4 {
                convention: Convention::ModelOpt,
                ..
            } => Scheme::Nvfp4ModelOpt,
            WeightFormat::Blocked { scheme, .. } => *scheme,
        }
    }
}

/// Which byte format block scales are in, for summaries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ScaleKind {
    E4m3,
    Ue8m0,
    F32,
}

/// Health of a weight's block scales, from the scale bytes alone.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScaleSummary {
    pub kind: ScaleKind,
    pub count: usize,
    /// Fraction of scale bytes equal to 0x00 (F32 scales: of values equal to 0).
    pub frac_zero: f64,
    /// Fraction at 0x7E, the largest E4M3 (448): saturated blocks.
    pub frac_7e: f64,
    /// Fraction of NaN scales (E4M3 0x7F/0xFF, UE8M0 0xFF, F32 NaN).
    pub frac_nan: f64,
    /// Fraction of bytes equal to 0xFF (UE8M0 NaN; for E4M3 the negative NaN).
    pub frac_ff: f64,
    /// Largest finite decoded scale magnitude (NaN when there is none).
    pub max_scale: f32,
}

fn is_float(d: Dtype) -> bool {
    matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16 | Dtype::F64)
}

/// Expected [out, in] of a canonical base from the config, with the config fields named.
pub fn expected_shape(cfg: &ModelConfig, base: &str) -> Option<((usize, usize), &'static str)> {
    let d = cfg.hidden_size;
    let hd = cfg.num_attention_heads * cfg.head_dim;
    let g = cfg.o_groups.max(1);
    let ii = cfg.moe_intermediate_size;
    let ish = ii * cfg.n_shared_experts.max(1);
    if base == "head" {
        return Some(((cfg.vocab_size, d), "vocab_size × hidden_size"));
    }
    let (layer, rest) = if let Some(r) = base.strip_prefix("layers.") {
        let dot = r.find('.')?;
        (r[..dot].parse::<usize>().ok(), &r[dot + 1..])
    } else if let Some(r) = base.strip_prefix("mtp.") {
        let dot = r.find('.')?;
        (None, &r[dot + 1..])
    } else {
        return None;
    };
    let ratio = layer.and_then(|l| cfg.compress_ratios.get(l).copied());
    let c = |r: usize| if r == 4 { 2 } else { 1 };
    let s = match rest {
        "attn.wq_a" => ((cfg.q_lora_rank, d), "q_lora_rank × hidden_size"),
        "attn.wq_b" => (
            (hd, cfg.q_lora_rank),
            "num_attention_heads·head_dim × q_lora_rank",
        ),
        "attn.wkv" => ((cfg.head_dim, d), "head_dim × hidden_size"),
        "attn.wo_a" => (
            (g * cfg.o_lora_rank, hd / g),
            "o_groups·o_lora_rank × num_attention_heads·head_dim/o_groups",
        ),
        "attn.wo_b" => (
            (d, g * cfg.o_lora_rank),
            "hidden_size × o_groups·o_lora_rank",
        ),
        "attn.compressor.wkv" | "attn.compressor.wgate" => (
            (c(ratio?) * cfg.head_dim, d),
            "c·head_dim × hidden_size (c = 2 when compress ratio is 4)",
        ),
        "attn.indexer.wq_b" => (
            (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
            "index_n_heads·index_head_dim × q_lora_rank",
        ),
        "attn.indexer.weights_proj" => ((cfg.index_n_heads, d), "index_n_heads × hidden_size"),
        "attn.indexer.compressor.wkv" | "attn.indexer.compressor.wgate" => (
            (c(ratio?) * cfg.index_head_dim, d),
            "c·index_head_dim × hidden_size",
        ),
        "ffn.gate" => ((cfg.n_routed_experts, d), "n_routed_experts × hidden_size"),
        "ffn.shared_experts.w1" | "ffn.shared_experts.w3" => (
            (ish, d),
            "moe_intermediate_size·n_shared_experts × hidden_size",
        ),
        "ffn.shared_experts.w2" => (
            (d, ish),
            "hidden_size × moe_intermediate_size·n_shared_experts",
        ),
        "e_proj" | "h_proj" => ((d, d), "hidden_size × hidden_size"),
        // the families' projections (checkpoint::naming's canonical names)
        r if cfg.family.is_some() && family_shape(cfg, r).is_some() => family_shape(cfg, r)?,
        r if r.starts_with("ffn.experts.") => {
            if r.ends_with(".w1") || r.ends_with(".w3") {
                ((ii, d), "moe_intermediate_size × hidden_size")
            } else if r.ends_with(".w13") {
                // gpt-oss: gate and up rows interleaved in one weight
                ((2 * ii, d), "2·intermediate_size × hidden_size")
            } else if r.ends_with(".w2") {
                ((d, ii), "hidden_size × moe_intermediate_size")
            } else {
                return None;
            }
        }
        _ => return None,
    };
    Some(s)
}

/// [`expected_shape`] of the names only the families have (`rest`: the name after `layers.N.`).
fn family_shape(cfg: &ModelConfig, rest: &str) -> Option<((usize, usize), &'static str)> {
    let f = cfg.family.as_ref()?;
    let d = cfg.hidden_size;
    let h = cfg.num_attention_heads;
    let kv = f.num_key_value_heads;
    let nope = cfg.head_dim - cfg.qk_rope_head_dim;
    let is_v3 = f.kind == crate::model::family::Kind::DeepseekV3;
    Some(match rest {
        "attn.q_proj" if is_v3 => (
            (h * cfg.head_dim, d),
            "num_attention_heads·(qk_nope_head_dim+qk_rope_head_dim) × hidden_size",
        ),
        "attn.q_proj" => (
            (h * cfg.head_dim, d),
            "num_attention_heads·head_dim × hidden_size",
        ),
        "attn.k_proj" => (
            (kv * cfg.head_dim, d),
            "num_key_value_heads·head_dim × hidden_size",
        ),
        "attn.v_proj" => (
            (kv * f.v_head_dim, d),
            "num_key_value_heads·head_dim × hidden_size",
        ),
        "attn.o_proj" if is_v3 => (
            (d, h * f.v_head_dim),
            "hidden_size × num_attention_heads·v_head_dim",
        ),
        "attn.o_proj" => (
            (d, h * f.v_head_dim),
            "hidden_size × num_attention_heads·head_dim",
        ),
        "attn.kv_a_proj_with_mqa" => (
            (f.kv_lora_rank + cfg.qk_rope_head_dim, d),
            "kv_lora_rank+qk_rope_head_dim × hidden_size",
        ),
        "attn.kv_b_proj" => (
            (h * (nope + f.v_head_dim), f.kv_lora_rank),
            "num_attention_heads·(qk_nope_head_dim+v_head_dim) × kv_lora_rank",
        ),
        "ffn.gate_proj" | "ffn.up_proj" => {
            ((f.intermediate_size, d), "intermediate_size × hidden_size")
        }
        "ffn.down_proj" => ((d, f.intermediate_size), "hidden_size × intermediate_size"),
        _ => return None,
    })
}

/// FP8 block size from `quantization_config.weight_block_size` (default 128×128).
fn fp8_block_size(ck: &Checkpoint) -> Result<[usize; 2]> {
    let Some(v) = ck
        .quantization_config()
        .and_then(|q| q.get("weight_block_size"))
    else {
        return Ok([128, 128]);
    };
    let arr: Vec<usize> = v
        .as_array()
        .map(|a| {
            a.iter()
                .filter_map(|x| x.as_u64().map(|n| n as usize))
                .collect()
        })
        .unwrap_or_default();
    if arr.len() != 2 || arr.contains(&0) {
        return Err(Error::bad(
            ck.config_path(),
            None,
            format!(
                "quantization_config.weight_block_size must be two positive integers, found {v}"
            ),
        ));
    }
    Ok([arr[0], arr[1]])
}

impl Checkpoint {
    fn cinfo(&self, base: &str, suffix: &str) -> Option<(String, TensorInfo)> {
        let c = format!("{base}.{suffix}");
        let i = self.canonical_info(&c)?;
        Some((c, i))
    }

    /// Raw name a missing sibling would have: the weight's raw name with its leaf replaced.
    fn sibling_raw(&self, weight_raw: &str, leaf: &str) -> String {
        for s in [".weight_packed", ".weight"] {
            if let Some(stem) = weight_raw.strip_suffix(s) {
                return format!("{stem}.{leaf}");
            }
        }
        format!("{weight_raw}.{leaf}")
    }

    /// A scalar tensor (shape [] or [1], float) as f32.
    fn scalar(&self, canonical: &str, info: &TensorInfo) -> Result<f32> {
        let raw = self.resolve(canonical).unwrap_or_default();
        if info.shape.iter().product::<usize>() != 1
            || info.shape.len() > 1
            || !is_float(info.dtype)
        {
            return Err(Error::bad(
                &info.file,
                Some(&raw),
                format!(
                    "tensor scale must be a float scalar ([] or [1]), found {:?} {:?}",
                    info.dtype, info.shape
                ),
            ));
        }
        Ok(self.tensor_f32(canonical)?.data[0])
    }

    fn check_shape(&self, raw: &str, info: &TensorInfo, want: &[usize], what: &str) -> Result<()> {
        if info.shape != want {
            return Err(Error::bad(
                &info.file,
                Some(raw),
                format!("{what} has shape {:?}, expected {:?}", info.shape, want),
            ));
        }
        Ok(())
    }

    /// Scheme, shapes and scalar scales of a linear weight, reading no packed or dense bytes;
    /// a logical shape that contradicts config.json is refused ([`Checkpoint::check_config_shape`]).
    pub fn weight_meta(&self, base: &str) -> Result<WeightMeta> {
        let m = self.weight_meta_unchecked(base)?;
        self.check_config_shape(&m)?;
        Ok(m)
    }

    /// A logical shape that contradicts what config.json fixes for the weight (nothing to check
    /// when the config is unusable: that is reported on its own). The refusal names the weight's
    /// file and tensor, config.json and the fields.
    pub fn check_config_shape(&self, meta: &WeightMeta) -> Result<()> {
        if let Ok(cfg) = self.model_config() {
            if let Some(((o, i), fields)) = expected_shape(cfg, &meta.canonical) {
                if (o, i) != (meta.out_features, meta.in_features) {
                    return Err(Error::bad(
                        &meta.file,
                        Some(&meta.tensors.weight),
                        format!(
                            "logical shape [{}, {}] contradicts config.json: expected [{o}, {i}] ({fields})",
                            meta.out_features, meta.in_features
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// [`Checkpoint::weight_meta`] without the check against config.json.
    pub fn weight_meta_unchecked(&self, base: &str) -> Result<WeightMeta> {
        if let Some(m) = self
            .meta_cache
            .lock()
            .ok()
            .and_then(|c| c.get(base).cloned())
        {
            return Ok(m);
        }
        let m = self.weight_meta_uncached(base)?;
        if let Ok(mut c) = self.meta_cache.lock() {
            c.insert(base.to_string(), m.clone());
        }
        Ok(m)
    }

    fn weight_meta_uncached(&self, base: &str) -> Result<WeightMeta> {
        let packed = self.cinfo(base, "weight_packed");
        let plain = self.cinfo(base, "weight");
        let (wc, wi) = match packed.clone().or(plain) {
            Some(x) => x,
            None => {
                return Err(self.missing(
                    &format!("{base}.weight"),
                    "no weight or weight_packed tensor under this name",
                ))
            }
        };
        let wraw = self.resolve(&wc).unwrap_or_default();
        let label = self.raw_label(&wc).unwrap_or_else(|| wraw.clone());
        let file = wi.file.clone();
        if wi.shape.len() != 2 {
            return Err(Error::bad(
                &file,
                Some(&label),
                format!("linear weight must be 2-D, found shape {:?}", wi.shape),
            ));
        }
        let (rows, cols) = (wi.shape[0], wi.shape[1]);
        let mut meta = WeightMeta {
            canonical: base.to_string(),
            out_features: rows,
            in_features: cols,
            scheme: Scheme::Dense,
            weight_dtype: wi.dtype,
            tensors: WeightTensors {
                weight: label.clone(),
                block_scale: None,
                global_scale: None,
                input_scale: None,
            },
            file: file.clone(),
            convention: None,
            weight_global: None,
            input_global: None,
            block: None,
            block_scale_dtype: None,
            fp8_scale_kind: None,
        };
        let leaf = if packed.is_some() {
            "weight_packed"
        } else {
            "weight"
        };
        if let Some((spec, sname, si)) = super::formats::generic_candidates(leaf, wi.dtype)
            .find_map(|spec| {
                spec.tensors.scale_leaves.iter().find_map(|l| {
                    self.cinfo(base, l)
                        .filter(|(_, si)| spec.tensors.scale_dtypes.contains(&si.dtype))
                        .map(|(n, si)| (spec, n, si))
                })
            })
        {
            self.generic_meta(&mut meta, spec, &sname, &si, &label)?;
        } else {
            self.specific_meta(&mut meta, base, &wc, &wi, packed.is_some(), &label)?;
        }
        Ok(meta)
    }

    /// A weight of a format read through the format table: its block scale `sname` (one of the
    /// spec's leaves and dtypes) checked against the weight's shape.
    fn generic_meta(
        &self,
        meta: &mut WeightMeta,
        spec: &'static super::formats::FormatSpec,
        sname: &str,
        si: &TensorInfo,
        label: &str,
    ) -> Result<()> {
        let d = spec.decode.expect("a generic format decodes");
        let super::formats::Block::Row(bn) = d.block else {
            unreachable!("generic formats have row blocks (table test)")
        };
        let name = spec.name;
        let inf = meta.in_features * d.elem.per_byte();
        meta.in_features = inf;
        if !inf.is_multiple_of(bn) {
            return Err(Error::bad(
                &meta.file,
                Some(label),
                format!("{name} in_features {inf} not a multiple of {bn}"),
            ));
        }
        let sraw = self.resolve(sname).unwrap_or_default();
        self.check_shape(
            &sraw,
            si,
            &[meta.out_features, inf / bn],
            &format!("{name} block scale [out, in/{bn}]"),
        )?;
        meta.scheme = spec.scheme;
        meta.block = Some([1, bn]);
        meta.block_scale_dtype = Some(si.dtype);
        meta.tensors.block_scale = Some(sraw);
        Ok(())
    }

    /// A weight of a format with its own reader (dense, NVFP4, MXFP4, FP8 block).
    fn specific_meta(
        &self,
        meta: &mut WeightMeta,
        base: &str,
        wc: &str,
        wi: &TensorInfo,
        packed: bool,
        label: &str,
    ) -> Result<()> {
        let wraw = self.resolve(wc).unwrap_or_default();
        let file = wi.file.clone();
        let label = label.to_string();
        let (rows, cols) = (wi.shape[0], wi.shape[1]);
        let need = |leaf: &str, what: &str| -> Error {
            self.missing(
                &self.sibling_raw(&wraw, leaf),
                format!("{what} for weight `{wraw}` in {}", file.display()),
            )
        };
        let is_packed_dtype = matches!(wi.dtype, Dtype::U8 | Dtype::I8);
        if packed || is_packed_dtype {
            if !is_packed_dtype {
                return Err(Error::bad(
                    &file,
                    Some(&label),
                    format!("packed 4-bit weight must be U8/I8, found {:?}", wi.dtype),
                ));
            }
            let inf = cols * 2;
            meta.in_features = inf;
            let ws = self.cinfo(base, "weight_scale");
            let sc = self.cinfo(base, "scale");
            let (sname, si) = match (ws, sc) {
                (Some(w), _) => w,
                (None, Some(s)) => s,
                (None, None) => {
                    // I8 is the official MXFP4 layout (`.scale`); U8 is NVFP4/CT-MXFP4 (`.weight_scale`).
                    let leaf = if wi.dtype == Dtype::I8 && !packed {
                        "scale"
                    } else {
                        "weight_scale"
                    };
                    return Err(need(
                        leaf,
                        "block scale (`weight_scale` for NVFP4, `scale`/`weight_scale` for MXFP4) missing",
                    ));
                }
            };
            let sraw = self.resolve(&sname).unwrap_or_default();
            meta.tensors.block_scale = Some(sraw.clone());
            meta.block_scale_dtype = Some(si.dtype);
            match si.dtype {
                Dtype::F8_E4M3 => {
                    if inf % nvfp4::BLOCK != 0 {
                        return Err(Error::bad(&file, Some(&label), format!("NVFP4 in_features {inf} not a multiple of 16")));
                    }
                    self.check_shape(&sraw, &si, &[rows, inf / nvfp4::BLOCK], "NVFP4 block scale [out, in/16]")?;
                    let (gleaf, ileaf, conv, scheme) = if packed {
                        ("weight_global_scale", "input_global_scale", Convention::CompressedTensors, Scheme::Nvfp4Ct)
                    } else {
                        ("weight_scale_2", "input_scale", Convention::ModelOpt, Scheme::Nvfp4ModelOpt)
                    };
                    let (gc, gi) = self
                        .cinfo(base, gleaf)
                        .ok_or_else(|| need(gleaf, "NVFP4 weight tensor scale missing"))?;
                    meta.weight_global = Some(self.scalar(&gc, &gi)?);
                    meta.tensors.global_scale = self.resolve(&gc);
                    if let Some((ic, ii)) = self.cinfo(base, ileaf) {
                        meta.input_global = Some(self.scalar(&ic, &ii)?);
                        meta.tensors.input_scale = self.resolve(&ic);
                    }
                    meta.scheme = scheme;
                    meta.convention = Some(conv);
                }
                Dtype::F8_E8M0 | Dtype::U8 => {
                    if inf % mxfp4::BLOCK != 0 {
                        return Err(Error::bad(&file, Some(&label), format!("MXFP4 in_features {inf} not a multiple of 32")));
                    }
                    self.check_shape(&sraw, &si, &[rows, inf / mxfp4::BLOCK], "MXFP4 block scale [out, in/32]")?;
                    meta.scheme = Scheme::Mxfp4;
                }
                other => {
                    return Err(Error::bad(
                        &si.file,
                        Some(&sraw),
                        format!("block scale of a packed 4-bit weight must be F8_E4M3 (NVFP4) or F8_E8M0/U8 (MXFP4), found {other:?}"),
                    ))
                }
            }
        } else if wi.dtype == Dtype::F8_E4M3 {
            let (sname, si) = self
                .cinfo(base, "scale")
                .or_else(|| self.cinfo(base, "weight_scale_inv"))
                .ok_or_else(|| {
                    need(
                        "scale",
                        "FP8 block scale (`scale` or `weight_scale_inv`) missing",
                    )
                })?;
            let sraw = self.resolve(&sname).unwrap_or_default();
            let kind = match si.dtype {
                Dtype::F8_E8M0 | Dtype::U8 => Fp8ScaleKind::Ue8m0,
                Dtype::F32 | Dtype::BF16 => Fp8ScaleKind::F32,
                other => {
                    return Err(Error::bad(
                        &si.file,
                        Some(&sraw),
                        format!("FP8 block scale must be F32 or F8_E8M0, found {other:?}"),
                    ))
                }
            };
            let block = fp8_block_size(self)?;
            let want = [rows.div_ceil(block[0]), cols.div_ceil(block[1])];
            if si.shape != want {
                return Err(Error::bad(
                    &si.file,
                    Some(&sraw),
                    format!(
                        "FP8 scale grid {:?} does not match weight [{rows}, {cols}] in {}×{} blocks (expected {want:?}; quantization_config.weight_block_size)",
                        si.shape, block[0], block[1]
                    ),
                ));
            }
            meta.scheme = Scheme::Fp8Block;
            meta.block = Some(block);
            meta.block_scale_dtype = Some(si.dtype);
            meta.fp8_scale_kind = Some(kind);
            meta.tensors.block_scale = Some(sraw);
        } else if !matches!(wi.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
            return Err(Error::bad(
                &file,
                Some(&label),
                format!("dtype {:?} is not a weight format this tool reads (BF16/F16/F32, F8_E4M3 + scale, U8/I8 packed FP4)", wi.dtype),
            ));
        }
        Ok(())
    }

    /// A linear weight with all its bytes and scales, ready to dequantise.
    pub fn weight(&self, base: &str) -> Result<QuantWeight> {
        let transposed = self.stored_transposed(&format!("{base}.weight"));
        let RawWeight { meta: m, format } = self.weight_raw(base)?;
        let format = match format {
            RawFormat::Dense { dtype, bytes } => {
                let mut values = convert::to_f32(&bytes, dtype, &m.file, &m.tensors.weight)?;
                if transposed {
                    // stored [in, out] (gpt-oss's fused experts)
                    values = super::experts::transpose(&values, m.in_features, m.out_features);
                }
                WeightFormat::Dense { dtype, values }
            }
            RawFormat::Fp8Block {
                bytes,
                scales,
                scale_kind,
                scale_raw,
                block,
            } => WeightFormat::Fp8Block {
                bytes: bytes.to_vec(),
                scales,
                scale_kind,
                scale_raw: scale_raw.to_vec(),
                block,
            },
            RawFormat::Mxfp4 { packed, scales } => WeightFormat::Mxfp4 {
                packed: packed.to_vec(),
                scales: scales.to_vec(),
            },
            RawFormat::Nvfp4 {
                packed,
                scales,
                convention,
                weight_global,
                input_global,
            } => WeightFormat::Nvfp4 {
                packed: packed.to_vec(),
                scales: scales.to_vec(),
                convention,
                weight_global,
                input_global,
            },
            RawFormat::Blocked {
                scheme,
                codes,
                scales,
            } => WeightFormat::Blocked {
                scheme,
                codes: codes.to_vec(),
                scales: scales.to_vec(),
            },
        };
        Ok(QuantWeight {
            canonical: m.canonical,
            out_features: m.out_features,
            in_features: m.in_features,
            format,
            tensors: m.tensors,
            file: m.file,
        })
    }

    /// A weight's metadata and the canonical names of its stored tensors (data and block
    /// scales), without reading any tensor data.
    pub fn weight_layout(&self, base: &str) -> Result<WeightLayout> {
        let meta = self.weight_meta(base)?;
        let weight = if self
            .canonical_info(&format!("{base}.weight_packed"))
            .is_some()
        {
            format!("{base}.weight_packed")
        } else {
            format!("{base}.weight")
        };
        let scale = self.scale_canonical(&meta);
        Ok(WeightLayout {
            meta,
            weight,
            scale,
        })
    }

    /// A weight's stored bytes borrowed from the mmap (no copy), for backends that upload them
    /// as they are. Dense weights and FP8 scale multipliers are widened to f32 (small). A dense
    /// weight stored transposed ([`Checkpoint::stored_transposed`]) comes in its stored
    /// [in, out] order; [`Checkpoint::weight`] gives it [out, in].
    pub fn weight_raw(&self, base: &str) -> Result<RawWeight<'_>> {
        let WeightLayout {
            meta: m,
            weight: wc,
            scale: sc_name,
        } = self.weight_layout(base)?;
        let scale_canon = |_: &Option<String>| sc_name.clone();
        let format = match m.scheme {
            Scheme::Dense => RawFormat::Dense {
                dtype: m.weight_dtype,
                bytes: self.canonical_bytes(&wc)?,
            },
            Scheme::Fp8Block => {
                let sc = scale_canon(&m.tensors.block_scale).unwrap_or_default();
                let scale_raw = self.canonical_bytes(&sc)?;
                let kind = m.fp8_scale_kind.unwrap_or(Fp8ScaleKind::F32);
                let scales = match kind {
                    Fp8ScaleKind::Ue8m0 => scale_raw.iter().map(|&b| ue8m0::decode(b)).collect(),
                    Fp8ScaleKind::F32 => self.tensor_f32(&sc)?.data.into_vec(),
                };
                RawFormat::Fp8Block {
                    bytes: self.canonical_bytes(&wc)?,
                    scales,
                    scale_kind: kind,
                    scale_raw,
                    block: m.block.unwrap_or([128, 128]),
                }
            }
            Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt => {
                let sc = scale_canon(&m.tensors.block_scale).unwrap_or_default();
                let scales = self.canonical_bytes(&sc)?;
                let packed = self.canonical_bytes(&wc)?;
                match m.convention {
                    Some(convention) => RawFormat::Nvfp4 {
                        packed,
                        scales,
                        convention,
                        weight_global: m.weight_global.unwrap_or(f32::NAN),
                        input_global: m.input_global,
                    },
                    None => RawFormat::Mxfp4 { packed, scales },
                }
            }
            // every format read through the table
            _ => {
                let sc = scale_canon(&m.tensors.block_scale).unwrap_or_default();
                RawFormat::Blocked {
                    scheme: m.scheme,
                    codes: self.canonical_bytes(&wc)?,
                    scales: self.canonical_bytes(&sc)?,
                }
            }
        };
        Ok(RawWeight { meta: m, format })
    }

    /// Canonical bases of every linear weight present, in natural order. Norms, the embedding
    /// and non-2-D tensors are not linear weights.
    pub fn weight_bases(&self) -> Vec<String> {
        let mut out = Vec::new();
        for c in self.canonical_names() {
            let base = match c
                .strip_suffix(".weight_packed")
                .or_else(|| c.strip_suffix(".weight"))
            {
                Some(b) => b,
                None => continue,
            };
            // A CT checkpoint has no `.weight`; a ModelOpt one has no `.weight_packed`: never both.
            if c.ends_with(".weight") && self.canon.contains_key(&format!("{base}.weight_packed")) {
                continue;
            }
            let leaf = base.rsplit('.').next().unwrap_or(base);
            if base == "embed" || leaf.ends_with("norm") {
                continue;
            }
            if self.canonical_info(&c).is_some_and(|i| i.shape.len() == 2) {
                out.push(base.to_string());
            }
        }
        out
    }

    /// Canonical name of a weight's block-scale tensor: the one its raw name maps to, or, for an
    /// expert's slice of a fused tensor (which has no single canonical name), the weight's
    /// sibling under a scale leaf that is stored in that tensor.
    fn scale_canonical(&self, meta: &WeightMeta) -> Option<String> {
        let r = meta.tensors.block_scale.as_ref()?;
        if let Some(c) = self.canonical_of(r) {
            return Some(c.to_string());
        }
        super::formats::TABLE
            .iter()
            .flat_map(|s| s.tensors.scale_leaves.iter())
            .chain(["weight_scale_inv"].iter())
            .map(|l| format!("{}.{l}", meta.canonical))
            .find(|c| self.resolve(c).as_ref() == Some(r))
    }

    /// The stored bytes of a weight's block scales (this weight's own: an expert's slice of a
    /// fused scale tensor); None without block scales.
    pub fn block_scale_bytes(
        &self,
        meta: &WeightMeta,
    ) -> Result<Option<std::borrow::Cow<'_, [u8]>>> {
        match self.scale_canonical(meta) {
            Some(c) => Ok(Some(self.canonical_bytes(&c)?)),
            None => Ok(None),
        }
    }

    /// Summarise a weight's block scales by reading only the scale tensor.
    pub fn scale_summary(&self, meta: &WeightMeta) -> Result<Option<ScaleSummary>> {
        let Some(sraw) = &meta.tensors.block_scale else {
            return Ok(None);
        };
        let Some(dtype) = meta.block_scale_dtype else {
            return Ok(None);
        };
        let Some(b) = self.block_scale_bytes(meta)? else {
            return Ok(None);
        };
        let file = self.info(sraw).map(|i| i.file).unwrap_or_default();
        let count;
        let (mut zero, mut x7e, mut nan, mut xff) = (0usize, 0usize, 0usize, 0usize);
        let mut max = f32::NAN;
        let kind;
        if matches!(dtype, Dtype::F8_E4M3 | Dtype::F8_E8M0 | Dtype::U8) {
            count = b.len();
            kind = if dtype == Dtype::F8_E4M3 {
                ScaleKind::E4m3
            } else {
                ScaleKind::Ue8m0
            };
            let st = byte_stats(&b, kind == ScaleKind::E4m3);
            (zero, x7e, nan, xff) = (st.zero, st.x7e, st.nan, st.ff);
            if let Some(code) = st.max_code {
                max = match kind {
                    ScaleKind::E4m3 => e4m3::decode(code),
                    _ => ue8m0::decode(code),
                };
            }
        } else {
            let v = convert::to_f32(&b, dtype, &file, sraw)?;
            count = v.len();
            kind = ScaleKind::F32;
            for &x in &v {
                if x.is_nan() {
                    nan += 1;
                } else {
                    if x == 0.0 {
                        zero += 1;
                    }
                    if max.is_nan() || x.abs() > max {
                        max = x.abs();
                    }
                }
            }
        }
        let f = |n: usize| {
            if count == 0 {
                0.0
            } else {
                n as f64 / count as f64
            }
        };
        Ok(Some(ScaleSummary {
            kind,
            count,
            frac_zero: f(zero),
            frac_7e: f(x7e),
            frac_nan: f(nan),
            frac_ff: f(xff),
            max_scale: max,
        }))
    }
}

/// The tensor amax a stored global scale implies: 2688/g (CT) or 2688·d (ModelOpt).
pub fn implied_amax(conv: Convention, stored: f32) -> f32 {
    match conv {
        Convention::CompressedTensors => 2688.0 / stored,
        Convention::ModelOpt => 2688.0 * stored,
    }
}

/// Largest decodable weight magnitude given the scales alone: max block scale × max element ×
/// tensor scale, in the producer's op order.
pub fn amax_from_scales(meta: &WeightMeta, s: &ScaleSummary) -> Option<f32> {
    use super::formats::Global;
    let d = meta.scheme.spec().decode?;
    Some(match d.global {
        Global::None => s.max_scale * d.elem.max(),
        Global::Divide => d.elem.max() * (s.max_scale / meta.weight_global?),
        Global::Multiply => d.elem.max() * (s.max_scale * meta.weight_global?),
    })
}

struct ByteStats {
    zero: usize,
    x7e: usize,
    nan: usize,
    ff: usize,
    /// Byte of the largest finite magnitude (sign cleared for E4M3).
    max_code: Option<u8>,
}

/// Scale-byte counts in one branch-free pass over 32 byte lanes with u8 counters (flushed
/// every 255 rows), which the compiler vectorises: a 256-expert layer has ~400 MB of scales.
/// For E4M3 the magnitude is the low 7 bits (byte order = value order) and 0x7F is NaN; for
/// UE8M0 the whole byte, with 0xFF NaN.
fn byte_stats(b: &[u8], e4m3_scale: bool) -> ByteStats {
    const L: usize = 32;
    let (mask, nan_code) = if e4m3_scale {
        (0x7Fu8, 0x7Fu8)
    } else {
        (0xFF, 0xFF)
    };
    let mut st = ByteStats {
        zero: 0,
        x7e: 0,
        nan: 0,
        ff: 0,
        max_code: None,
    };
    let mut best: Option<u8> = None;
    let one = |x: u8, st: &mut ByteStats, best: &mut Option<u8>| {
        let m = x & mask;
        st.zero += (x == 0) as usize;
        st.x7e += (x == 0x7E) as usize;
        st.ff += (x == 0xFF) as usize;
        if m == nan_code {
            st.nan += 1;
        } else {
            *best = (*best).max(Some(m));
        }
    };
    for block in b.chunks(L * 255) {
        let (mut z, mut e, mut n, mut f, mut mx, mut fin) =
            ([0u8; L], [0u8; L], [0u8; L], [0u8; L], [0u8; L], [0u8; L]);
        let rows = block.chunks_exact(L);
        let rest = rows.remainder();
        for row in rows {
            for i in 0..L {
                let x = row[i];
                let m = x & mask;
                let nan = m == nan_code;
                // wrapping: no overflow-check branches in the hot loop (≤ 255 rows per block).
                z[i] = z[i].wrapping_add((x == 0) as u8);
                e[i] = e[i].wrapping_add((x == 0x7E) as u8);
                f[i] = f[i].wrapping_add((x == 0xFF) as u8);
                n[i] = n[i].wrapping_add(nan as u8);
                mx[i] = mx[i].max(if nan { 0 } else { m });
                fin[i] |= (!nan) as u8;
            }
        }
        for i in 0..L {
            st.zero += z[i] as usize;
            st.x7e += e[i] as usize;
            st.ff += f[i] as usize;
            st.nan += n[i] as usize;
            if fin[i] != 0 {
                best = best.max(Some(mx[i]));
            }
        }
        for &x in rest {
            one(x, &mut st, &mut best);
        }
    }
    if !e4m3_scale {
        st.x7e = 0;
    }
    st.max_code = best;
    st
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_stats_counts_and_max() {
        // E4M3: 0x7E = 448 is the largest magnitude; 0xFE = -448 too; 0x7F/0xFF are NaN.
        let mut b = vec![0x38u8; 100_000];
        b[5] = 0x00;
        b[70_000] = 0x7E;
        b[70_001] = 0x7F;
        b[99_999] = 0xFF;
        let s = byte_stats(&b, true);
        assert_eq!((s.zero, s.x7e, s.nan, s.ff), (1, 1, 2, 1));
        assert_eq!(s.max_code, Some(0x7E));
        let s = byte_stats(&[0xB8, 0x30], true); // -1.0 and 0.5: max magnitude is 1.0 (0x38)
        assert_eq!(s.max_code, Some(0x38));
        assert_eq!(byte_stats(&[0x7F, 0xFF], true).max_code, None);
        // UE8M0: 0xFF is NaN, max over the rest.
        let s = byte_stats(&[0xFF, 0x80, 0x7F, 0x00], false);
        assert_eq!((s.zero, s.nan, s.ff), (1, 1, 1));
        assert_eq!(s.max_code, Some(0x80));
    }
}
