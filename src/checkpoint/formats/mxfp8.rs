//! MXFP8 (OCP MX v1.0): E4M3 elements, one UE8M0 scale per 32 contiguous elements of a row
//! (along the input dimension), no tensor scale. Stored the way ModelOpt exports it and vLLM's
//! `ModelOptMxFp8LinearMethod` reads it: `weight` float8_e4m3fn [out, in] and `weight_scale`
//! uint8 (E8M0 bytes; F8_E8M0 accepted too) [out, in/32], `quant_algo: "MXFP8"`. Served like the
//! other E4M3-weight formats (exact dequantized weight, FP8 1×128 activations, BF16 output).
//!
//! Everything about the format is this file: the table reads, dequantizes, serves, lints and
//! synthesizes it from [`SPEC`].

use rayon::prelude::*;
use serde_json::json;

use super::*;

/// Elements per block.
pub const BLOCK: usize = 32;

pub static SPEC: FormatSpec = FormatSpec {
    scheme: Scheme::Mxfp8,
    label: "mxfp8",
    name: "MXFP8",
    family: "mxfp8",
    // The served recipe is FP8 block's (E4M3 weight with power-of-two scales, FP8 1×128
    // activations); 1×32 blocks are finer than 128×128 tiles, so its rows bound MXFP8's error.
    tolerance_key: Some("fp8-block"),
    tensors: Tensors {
        weight_leaf: "weight",
        weight_dtypes: &[Dtype::F8_E4M3],
        scale_leaves: &["weight_scale"],
        scale_dtypes: &[Dtype::U8, Dtype::F8_E8M0],
        global_leaf: None,
        input_leaf: None,
        generic: true,
        fused_experts: None,
    },
    decode: Some(Decode {
        elem: Elem::E4m3,
        scale: ScaleCode::Ue8m0,
        block: Block::Row(BLOCK),
        global: Global::None,
    }),
    served: Served::Fp8Act,
    lint: Lint {
        amax: AmaxRule::BlockMax {
            inverted: false,
            fix: "Check the exponent bias (127) of the MXFP8 scales (OCP MX v1.0 §5.4: E8M0 stores 2^(b-127)).",
        },
    },
    config: ConfigClaims {
        // compressed-tensors' MXFP8 (`format: mxfp8-quantized`) stores the same tensors.
        ct_format: Some("mxfp8"),
        modelopt_algo: Some("MXFP8"),
        in_fp8: InFp8::Never,
    },
    synth: Some(Synth {
        format_name: "mxfp8",
        encode,
        config,
    }),
};

/// UE8M0 byte of a block with largest magnitude `amax`: 2^ceil(log2(amax/448)), so the block's
/// largest element never clips (ModelOpt's and FlashInfer's rounding of MX scales; the OCP
/// example rule 2^(floor(log2 amax) − 8) clips elements in (448, 512)·scale to 448). Clamped to
/// [0x00, 0xFE]; zero and tiny blocks get 0x00 (2^-127).
pub fn scale_byte(amax: f32) -> u8 {
    ue8m0::encode(amax.abs() / e4m3::MAX, ue8m0::Ue8m0Rounding::Ceil)
}

/// Quantize a row-major [rows, cols] weight (cols a multiple of 32): E4M3 codes (RNE,
/// saturating at ±448) of x / scale and the scale bytes [rows, cols/32].
pub fn quantize(w: &[f32], rows: usize, cols: usize) -> (Vec<u8>, Vec<u8>) {
    assert_eq!(cols % BLOCK, 0);
    assert_eq!(w.len(), rows * cols);
    let nb = cols / BLOCK;
    let mut codes = vec![0u8; rows * cols];
    let mut scales = vec![0u8; rows * nb];
    codes
        .par_chunks_mut(cols.max(1))
        .zip(scales.par_chunks_mut(nb.max(1)))
        .zip(w.par_chunks(cols.max(1)))
        .for_each(|((c, s), x)| {
            for b in 0..nb {
                let blk = &x[b * BLOCK..(b + 1) * BLOCK];
                let amax = blk.iter().fold(0f32, |a, v| a.max(v.abs()));
                s[b] = scale_byte(amax);
                let sc = ue8m0::decode(s[b]);
                for (k, &v) in blk.iter().enumerate() {
                    c[b * BLOCK + k] = e4m3::encode_satfinite(v / sc);
                }
            }
        });
    (codes, scales)
}

/// The synth encoder: `weight` F8_E4M3 and `weight_scale` U8 (ModelOpt's dtypes).
fn encode(w: &[f32], rows: usize, cols: usize) -> Vec<Stored> {
    let (codes, scales) = quantize(w, rows, cols);
    vec![
        Stored {
            leaf: "weight",
            dtype: Dtype::F8_E4M3,
            shape: vec![rows, cols],
            bytes: codes,
        },
        Stored {
            leaf: "weight_scale",
            dtype: Dtype::U8,
            shape: vec![rows, cols / BLOCK],
            bytes: scales,
        },
    ]
}

/// ModelOpt's MXFP8 export config: `quantization_config` and `hf_quant_config.json`.
fn config(excluded: &[String]) -> (Value, Option<Value>) {
    let qc = json!({
        "quant_method": "modelopt",
        "quant_algo": "MXFP8",
        "kv_cache_quant_algo": null,
        "exclude_modules": excluded,
    });
    let hq = json!({
        "producer": {"name": "modelopt", "version": "0.47.0"},
        "quantization": {
            "quant_algo": "MXFP8",
            "kv_cache_quant_algo": null,
            "exclude_modules": excluded,
        },
    });
    (qc, Some(hq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_is_the_smallest_power_of_two_that_holds_the_block() {
        assert_eq!(scale_byte(448.0), 127); // 448 / 448 = 2^0
        assert_eq!(scale_byte(449.0), 128);
        assert_eq!(scale_byte(1.0), 127 - 8); // 1/448 → 2^-8 (1/256 ≥ 1/448 > 1/512)
                                              // 2^-11 (251 fits); 2^-12, the OCP floor rule's choice, would need 502 > 448
        assert_eq!(scale_byte(0.122_558_59), 116);
        assert_eq!(scale_byte(0.0), 0);
    }

    #[test]
    fn quantize_then_decode_is_within_half_an_e4m3_step() {
        let (rows, cols) = (3, 64);
        let w: Vec<f32> = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) * 0.013)
            .collect();
        let (c, s) = quantize(&w, rows, cols);
        let d = decode_blocked(&SPEC.decode.unwrap(), &c, &s, rows, cols);
        for (i, (&x, &y)) in w.iter().zip(&d).enumerate() {
            let sc = ue8m0::decode(s[i / BLOCK]);
            // E4M3 has 3 mantissa bits: |x − q| ≤ 2^-4·|x| for normals, ≤ 2^-10·sc below.
            assert!(
                (x - y).abs() <= x.abs() / 16.0 + sc / 1024.0,
                "{i}: {x} vs {y}"
            );
        }
    }
}
