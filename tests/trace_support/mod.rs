//! Reading transformers' traces in the reference tests (tests/hf_reference.rs for V4,
//! tests/hf_families.rs for the other families): a trace tensor as f32, and the relative L2
//! error the tests bound.
#![allow(dead_code)]

/// A trace tensor's values as f32 (F32 as stored; I64 token ids converted).
pub fn f32s(t: &safetensors::tensor::TensorView) -> Vec<f32> {
    match t.dtype() {
        safetensors::Dtype::F32 => t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        safetensors::Dtype::I64 => t
            .data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as f32)
            .collect(),
        d => panic!("unexpected dtype {d:?}"),
    }
}

/// ‖a − b‖ / ‖b‖ in f64 (‖a − b‖ when b is zero).
pub fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let (mut e, mut n) = (0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        e += ((x - y) as f64).powi(2);
        n += (*y as f64).powi(2);
    }
    if n == 0.0 {
        e.sqrt()
    } else {
        (e / n).sqrt()
    }
}
