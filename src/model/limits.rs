//! The limits of the DeepSeek-V4 family that `config.json` is held to before anything is built
//! from it.
//!
//! Why: every size in the config drives an allocation or a loop (the default attention schedule
//! is one entry per layer, the graph three weight names per expert, Sinkhorn `hc_sinkhorn_iters`
//! rounds per token), so a lying config must be refused before it is used, naming the field. The
//! bounds are generous — 10× to 1000× the largest released model (V4-Pro: hidden 7168, 61 layers,
//! 384 experts, 128 heads, hc_mult 4, 20 Sinkhorn rounds) — and keep every product of two or
//! three sizes inside 64 bits, so later arithmetic cannot overflow. Token-dependent memory is
//! checked separately, against what the machine has (`probe::budget`).

use serde_json::Value;

use crate::{Error, Result};

/// An integer config field's accepted range, with the reason shown in refusals.
#[derive(Clone, Copy, Debug)]
pub struct Range {
    pub field: &'static str,
    pub min: u64,
    pub max: u64,
    pub why: &'static str,
}

const fn r(field: &'static str, min: u64, max: u64, why: &'static str) -> Range {
    Range {
        field,
        min,
        max,
        why,
    }
}

/// Widths of activations and weights (hidden, LoRA ranks, expert width, head dims).
const DIM: u64 = 1 << 16;

pub const HIDDEN_SIZE: Range = r("hidden_size", 1, DIM, "the residual width");
pub const NUM_HIDDEN_LAYERS: Range = r(
    "num_hidden_layers",
    1,
    10_000,
    "a model has at least one layer; V4-Pro has 61",
);
pub const VOCAB_SIZE: Range = r(
    "vocab_size",
    1,
    1 << 24,
    "token ids are drawn from the vocabulary; V4 has 129280",
);
pub const NUM_ATTENTION_HEADS: Range = r("num_attention_heads", 1, 4096, "V4-Pro has 128");
pub const HEAD_DIM: Range = r("head_dim", 2, DIM, "V4 has 512");
pub const QK_ROPE_HEAD_DIM: Range = r(
    "qk_rope_head_dim",
    2,
    DIM,
    "the rotary part of each head (interleaved pairs); V4 has 64",
);
pub const Q_LORA_RANK: Range = r("q_lora_rank", 1, DIM, "V4-Pro has 1536");
pub const O_GROUPS: Range = r("o_groups", 1, 4096, "the grouped output projection");
pub const O_LORA_RANK: Range = r("o_lora_rank", 1, DIM, "V4-Pro has 1024");
pub const SLIDING_WINDOW: Range = r(
    "sliding_window",
    1,
    1 << 24,
    "the window includes the query itself, so it holds at least one key",
);
pub const HC_MULT: Range = r(
    "hc_mult",
    1,
    16,
    "residual-stream copies; V4 has 4 (the CUDA kernels take up to 8)",
);
pub const HC_SINKHORN_ITERS: Range = r(
    "hc_sinkhorn_iters",
    0,
    1000,
    "Sinkhorn rounds per token and layer; V4 has 20",
);
pub const N_ROUTED_EXPERTS: Range = r("n_routed_experts", 1, 4096, "V4-Pro has 384");
pub const NUM_EXPERTS_PER_TOK: Range = r(
    "num_experts_per_tok",
    1,
    4096,
    "routed experts per token, at most `n_routed_experts`; V4 has 6",
);
pub const N_SHARED_EXPERTS: Range = r("n_shared_experts", 0, 64, "V4 has 1");
pub const MOE_INTERMEDIATE_SIZE: Range = r("moe_intermediate_size", 1, DIM, "V4-Pro has 3072");
pub const INDEX_N_HEADS: Range = r(
    "index_n_heads",
    1,
    1024,
    "the CSA indexer's heads; V4 has 64",
);
pub const INDEX_HEAD_DIM: Range = r("index_head_dim", 2, DIM, "V4 has 128");
pub const INDEX_TOPK: Range = r(
    "index_topk",
    1,
    1 << 20,
    "compressed rows each query keeps; V4 has 512 or 1024",
);

/// Every integer limit, for messages and documentation (README "Limits and exit codes").
pub const INTEGER_LIMITS: &[Range] = &[
    HIDDEN_SIZE,
    NUM_HIDDEN_LAYERS,
    VOCAB_SIZE,
    NUM_ATTENTION_HEADS,
    HEAD_DIM,
    QK_ROPE_HEAD_DIM,
    Q_LORA_RANK,
    O_GROUPS,
    O_LORA_RANK,
    SLIDING_WINDOW,
    HC_MULT,
    HC_SINKHORN_ITERS,
    N_ROUTED_EXPERTS,
    NUM_EXPERTS_PER_TOK,
    N_SHARED_EXPERTS,
    MOE_INTERMEDIATE_SIZE,
    INDEX_N_HEADS,
    INDEX_HEAD_DIM,
    INDEX_TOPK,
];

/// The largest compress ratio: HCA pools this many tokens into one row (V4: 128).
pub const MAX_COMPRESS_RATIO: u64 = 1024;

impl Range {
    /// `v` as a usize when inside the range; otherwise the refusal, naming the field.
    pub fn check(&self, v: u64) -> Result<usize> {
        if v < self.min || v > self.max {
            return Err(Error::usage(format!(
                "config field `{}` = {v} is outside {}..={} ({})",
                self.field, self.min, self.max, self.why
            )));
        }
        Ok(v as usize)
    }
}

/// A layer's compress ratio: 0 (sliding window only), 4 (CSA: overlapping 4-token compressor and
/// the indexer) or another power of two from 2 to [`MAX_COMPRESS_RATIO`] (HCA pooling).
pub fn check_compress_ratio(layer: usize, r: u64) -> Result<usize> {
    if r == 0 || (r.is_power_of_two() && (2..=MAX_COMPRESS_RATIO).contains(&r)) {
        return Ok(r as usize);
    }
    Err(Error::usage(format!(
        "config field `compress_ratios` entry {r} of layer {layer} is not 0 (window only), 4 (CSA) or a power of two from 2 to {MAX_COMPRESS_RATIO} (HCA)"
    )))
}

/// What a float config field may be, besides finite.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Sign {
    Any,
    NonNegative,
    Positive,
}

/// A float field that must be finite and of the given sign (NaN or ±inf would flow into every
/// op, and into casts that silently saturate).
pub fn check_float(field: &str, v: f64, sign: Sign) -> Result<f64> {
    let ok = v.is_finite()
        && match sign {
            Sign::Any => true,
            Sign::NonNegative => v >= 0.0,
            Sign::Positive => v > 0.0,
        };
    if ok {
        return Ok(v);
    }
    let want = match sign {
        Sign::Any => "a finite number",
        Sign::NonNegative => "a finite number ≥ 0",
        Sign::Positive => "a finite number > 0",
    };
    Err(Error::usage(format!(
        "config field `{field}` = {v} is not {want}"
    )))
}

/// What a typed config field may hold when it is not a number (numbers: [`Range`],
/// [`check_float`]): the one reader of booleans and names, so that a value of the wrong type is
/// refused naming the field instead of being read as its default (`"false"` read as true,
/// `scoring_func: 5` as the default scoring).
pub enum Typed<'a> {
    /// `true` or `false`.
    Bool,
    /// A string.
    Str,
    /// One of these strings.
    OneOf(&'a [&'a str]),
}

/// The field's value checked against `want`: `None` when absent or null (the caller's default
/// applies), else the value, or the refusal naming `field` and what it holds.
pub fn typed<'v>(field: &str, v: Option<&'v Value>, want: Typed) -> Result<Option<&'v Value>> {
    let Some(x) = v.filter(|x| !x.is_null()) else {
        return Ok(None);
    };
    let why = match (&want, x) {
        (Typed::Bool, Value::Bool(_)) | (Typed::Str, Value::String(_)) => return Ok(Some(x)),
        (Typed::OneOf(ok), Value::String(s)) if ok.contains(&s.as_str()) => return Ok(Some(x)),
        (Typed::Bool, _) => "is not a boolean (true or false)".to_string(),
        (Typed::Str, _) => "is not a string".to_string(),
        (Typed::OneOf(ok), _) => format!("is not one of {}", ok.join(", ")),
    };
    Err(Error::usage(format!("config field `{field}` {why}: {x}")))
}

/// [`typed`] of a boolean, `default` when absent.
pub fn bool_field(field: &str, v: Option<&Value>, default: bool) -> Result<bool> {
    Ok(typed(field, v, Typed::Bool)?
        .and_then(Value::as_bool)
        .unwrap_or(default))
}

/// [`typed`] of a name: `None` when absent.
pub fn str_field(
    field: &str,
    v: Option<&Value>,
    allowed: Option<&[&str]>,
) -> Result<Option<String>> {
    let want = match allowed {
        Some(a) => Typed::OneOf(a),
        None => Typed::Str,
    };
    Ok(typed(field, v, want)?
        .and_then(Value::as_str)
        .map(str::to_string))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_refuse_outside_and_name_the_field() {
        assert_eq!(HC_MULT.check(4).unwrap(), 4);
        let e = HC_MULT.check(1_000_000).unwrap_err().to_string();
        assert!(e.contains("`hc_mult`") && e.contains("1000000"), "{e}");
        assert!(SLIDING_WINDOW.check(0).is_err());
        assert!(NUM_HIDDEN_LAYERS.check(0).is_err());
        assert!(HC_SINKHORN_ITERS.check(0).is_ok());
        assert!(HC_SINKHORN_ITERS.check(1_000_000_000_000).is_err());
    }

    #[test]
    fn products_of_three_sizes_fit_in_64_bits() {
        // vocab × hidden, heads × head_dim × q_lora, experts × 3 × expert width × hidden
        let m = |r: Range| r.max as u128;
        assert!(m(VOCAB_SIZE) * m(HIDDEN_SIZE) * 8 < u64::MAX as u128);
        assert!(m(NUM_ATTENTION_HEADS) * m(HEAD_DIM) * m(Q_LORA_RANK) < u64::MAX as u128);
        assert!(
            m(N_ROUTED_EXPERTS) * 3 * m(MOE_INTERMEDIATE_SIZE) * m(HIDDEN_SIZE) * 8
                < u64::MAX as u128
        );
        assert!(m(INDEX_N_HEADS) * m(INDEX_HEAD_DIM) * m(Q_LORA_RANK) < u64::MAX as u128);
    }

    #[test]
    fn compress_ratios() {
        for ok in [0, 2, 4, 8, 128, 1024] {
            assert_eq!(check_compress_ratio(0, ok).unwrap(), ok as usize);
        }
        for bad in [1, 3, 6, 100, 2048, 1_000_000_000] {
            let e = check_compress_ratio(7, bad).unwrap_err().to_string();
            assert!(
                e.contains("compress_ratios") && e.contains("layer 7"),
                "{e}"
            );
        }
    }

    #[test]
    fn floats() {
        assert!(check_float("rope_theta", 1e4, Sign::Positive).is_ok());
        assert!(check_float("rope_theta", 0.0, Sign::Positive).is_err());
        assert!(check_float("rms_norm_eps", -1e-6, Sign::NonNegative).is_err());
        assert!(check_float("rms_norm_eps", 0.0, Sign::NonNegative).is_ok());
        assert!(check_float("swiglu_limit", -1.0, Sign::Any).is_ok());
        assert!(check_float("swiglu_limit", f64::NAN, Sign::Any).is_err());
        assert!(check_float("hc_eps", f64::INFINITY, Sign::NonNegative).is_err());
    }
}
