//! The precision a trace's values carry, whatever container they are stored in.
//!
//! Capture scripts usually write F32 tensors even when the engine ran in BF16, so the stored dtype
//! says little. The values do: a BF16 run's linear outputs are all BF16 numbers (the low 16 bits of
//! every f32 are zero), an FP16 run's all FP16 numbers, a dumped FP8 activation all E4M3 numbers.
//! [`carried`] finds the coarsest of those formats that represents every finite value exactly.
//!
//! The values of one tensor are not the whole story: under autocast the model's float32 parts
//! (hyper-connection mixing, norms, softmax) produce values that are not BF16 numbers although
//! their inputs carried BF16 rounding (transformers' DeepseekV4 feeds BF16 matmul outputs into its
//! float32 Sinkhorn). So the precision a *run* computes at is the coarsest precision any of its
//! computed outputs carries (an FP8 tensor is a quantized activation dump, not the run's
//! arithmetic, and holds only itself), and every op of the trace is held to the coarser of its own
//! and the run's precision.

use serde::Serialize;

use crate::numerics::{bf16, e4m3};

/// A floating-point format values may carry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Precision {
    F32,
    F16,
    Bf16,
    Fp8E4m3,
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
            Precision::Fp8E4m3 => "fp8-e4m3",
        }
    }

    /// Unit roundoff 2^-(mantissa bits + 1): the largest relative error of one rounding.
    pub fn unit_roundoff(self) -> f64 {
        match self {
            Precision::F32 => 2f64.powi(-24),
            Precision::F16 => 2f64.powi(-11),
            Precision::Bf16 => 2f64.powi(-8),
            Precision::Fp8E4m3 => 2f64.powi(-4),
        }
    }

    /// Round to the nearest value of the format (f32 unchanged; FP8 saturates at ±448).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::F16 => half::f16::from_f32(x).to_f32(),
            Precision::Bf16 => bf16::round(x),
            Precision::Fp8E4m3 => e4m3::decode(e4m3::encode_satfinite(x)),
        }
    }

    /// Whether `x` is a value of the format.
    pub fn holds(self, x: f32) -> bool {
        !x.is_finite() || self.round(x).to_bits() == x.to_bits() || (x == 0.0)
    }

    /// The coarser of two (larger unit roundoff).
    pub fn coarser(self, o: Precision) -> Precision {
        self.max(o)
    }

    /// The stored dtype's own precision (safetensors names).
    pub fn of_dtype(dtype: &str) -> Precision {
        match dtype {
            "BF16" => Precision::Bf16,
            "F16" => Precision::F16,
            "F8_E4M3" => Precision::Fp8E4m3,
            _ => Precision::F32,
        }
    }
}

/// The coarsest format that holds every value exactly (at least the stored dtype's); values
/// that are all zero carry nothing beyond the stored dtype. When both BF16 and FP16 hold every
/// value (small integers, powers of two), BF16 is taken: the looser of the two.
pub fn carried(values: &[f32], stored_dtype: &str) -> Precision {
    let stored = Precision::of_dtype(stored_dtype);
    if values.iter().all(|&v| v == 0.0 || !v.is_finite()) {
        return stored;
    }
    for p in [Precision::Fp8E4m3, Precision::Bf16, Precision::F16] {
        if p <= stored {
            break;
        }
        if values.iter().all(|&v| p.holds(v)) {
            return p;
        }
    }
    stored
}

/// rel-L2 of rounding `values` to `p`: the noise one rounding to that format puts on this op's
/// own values.
pub fn rounding_rel_l2(p: Precision, values: &[f32]) -> f64 {
    if p == Precision::F32 {
        return 0.0;
    }
    let (mut num, mut den) = (0f64, 0f64);
    for &v in values {
        if v.is_finite() {
            let d = (p.round(v) - v) as f64;
            num += d * d;
            den += (v as f64) * (v as f64);
        }
    }
    if den > 0.0 {
        (num / den).sqrt()
    } else {
        0.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data() -> Vec<f32> {
        (1..3000)
            .map(|i| (i as f32 * 0.7311).sin() * 3.0 + 0.01)
            .collect()
    }

    #[test]
    fn values_reveal_their_format_in_an_f32_container() {
        let x = data();
        assert_eq!(carried(&x, "F32"), Precision::F32);
        let b: Vec<f32> = x.iter().map(|&v| bf16::round(v)).collect();
        assert_eq!(carried(&b, "F32"), Precision::Bf16);
        let h: Vec<f32> = x.iter().map(|&v| half::f16::from_f32(v).to_f32()).collect();
        assert_eq!(carried(&h, "F32"), Precision::F16);
        let q: Vec<f32> = x.iter().map(|&v| Precision::Fp8E4m3.round(v)).collect();
        assert_eq!(carried(&q, "F32"), Precision::Fp8E4m3);
        // a stored BF16 tensor is BF16 whatever its values
        assert_eq!(carried(&b, "BF16"), Precision::Bf16);
        assert_eq!(carried(&[0.0; 8], "F32"), Precision::F32);
        // one value off the grid is enough to be F32
        let mut b2 = b.clone();
        b2[17] = f32::from_bits(b2[17].to_bits() + 1);
        assert_eq!(carried(&b2, "F32"), Precision::F32);
    }

    #[test]
    fn rounding_noise_is_below_the_unit_roundoff() {
        let x = data();
        for p in [Precision::F16, Precision::Bf16, Precision::Fp8E4m3] {
            let e = rounding_rel_l2(p, &x);
            assert!(e > 0.0 && e < p.unit_roundoff(), "{p:?} {e}");
            // and not far below it: one rounding costs about u/√3 of RMS
            assert!(e > p.unit_roundoff() / 4.0, "{p:?} {e}");
        }
        assert_eq!(rounding_rel_l2(Precision::F32, &x), 0.0);
        assert!(Precision::Bf16.coarser(Precision::F16) == Precision::Bf16);
    }
}
