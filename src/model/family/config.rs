//! A family's `config.json` as its transformers configuration class writes it (and as the hub
//! releases ship it), every field checked against limits as it is read: a value outside them is
//! refused with the field named (the caller names the file; exit 2), so nothing is sized from it.

use serde_json::Value;

use super::super::config::ModelConfig;
use super::super::limits::{self, Range, Sign};
use super::kind::{Family, Kind, RopeStyle};
use crate::{Error, Result};

mod gpt_oss;
use gpt_oss::gpt_oss;

/// Limits of the fields only the families have.
const NUM_KEY_VALUE_HEADS: Range = Range {
    field: "num_key_value_heads",
    min: 1,
    max: 4096,
    why: "key/value heads of the grouped-query attention; Qwen3-235B has 4",
};
const INTERMEDIATE_SIZE: Range = Range {
    field: "intermediate_size",
    min: 1,
    max: 1 << 18,
    why: "the dense MLP's width",
};
const DECODER_SPARSE_STEP: Range = Range {
    field: "decoder_sparse_step",
    min: 1,
    max: 10_000,
    why: "every n-th layer is sparse; Qwen3-MoE has 1",
};

/// Reads fields of one config object, each against its limit; errors name the field.
struct Reader<'a> {
    v: &'a Value,
}

impl Reader<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.v.get(key).filter(|x| !x.is_null())
    }
    /// The first of `keys` present (the spellings of one field), else `default`.
    fn usize(&self, keys: &[&'static str], default: Option<usize>, lim: &Range) -> Result<usize> {
        let hit = keys.iter().find_map(|k| self.get(k).map(|x| (*k, x)));
        let (name, n) = match hit {
            Some((k, x)) => (
                k,
                x.as_u64().ok_or_else(|| {
                    Error::usage(format!(
                        "config field `{k}` is not a non-negative integer: {x}"
                    ))
                })?,
            ),
            None => (
                keys[0],
                default
                    .ok_or_else(|| Error::usage(format!("config field `{}` is missing", keys[0])))?
                    as u64,
            ),
        };
        Range {
            field: name,
            ..*lim
        }
        .check(n)
    }
    fn float(&self, key: &str, default: f64, sign: Sign) -> Result<f64> {
        match self.get(key) {
            Some(x) => {
                let f = x.as_f64().ok_or_else(|| {
                    Error::usage(format!("config field `{key}` is not a number: {x}"))
                })?;
                limits::check_float(key, f, sign)
            }
            None => Ok(default),
        }
    }
    fn bool(&self, key: &str, default: bool) -> Result<bool> {
        limits::bool_field(key, self.get(key), default)
    }
}

/// The rope's base and type: `rope_parameters` (transformers 5) or top-level `rope_theta` with
/// `rope_scaling` (the hub configs). Only the default rope is read here; a family that scales it
/// says so.
fn rope_theta(r: &Reader, default: f64) -> Result<(f64, Option<String>)> {
    let params = r.get("rope_parameters").or_else(|| r.get("rope_scaling"));
    let theta = match params
        .and_then(|p| p.get("rope_theta"))
        .filter(|x| !x.is_null())
    {
        Some(x) => {
            let f = x.as_f64().ok_or_else(|| {
                Error::usage(format!(
                    "config field `rope_parameters.rope_theta` is not a number: {x}"
                ))
            })?;
            limits::check_float("rope_parameters.rope_theta", f, Sign::Positive)?
        }
        None => r.float("rope_theta", default, Sign::Positive)?,
    };
    // a number or another non-name is refused, not read as the default rope
    let ty = match params {
        Some(p) => {
            let section = if r.get("rope_parameters").is_some() {
                "rope_parameters"
            } else {
                "rope_scaling"
            };
            let key = if p.get("rope_type").is_some_and(|x| !x.is_null()) {
                "rope_type"
            } else {
                "type"
            };
            limits::str_field(&format!("{section}.{key}"), p.get(key), None)?
        }
        None => None,
    };
    Ok((theta, ty))
}

/// A family config as a [`ModelConfig`]: the shared fields read from the family's spelling, the
/// V4-only ones (mHC, compressor, indexer, grouped output) set to the values under which they do
/// nothing and the memory estimate counts them as nothing.
pub fn parse(v: &Value, kind: Kind) -> Result<ModelConfig> {
    let cfg = match kind {
        Kind::Qwen3Moe => qwen3_moe(v)?,
        Kind::DeepseekV3 => deepseek_v3(v)?,
        Kind::GptOss => gpt_oss(v)?,
    };
    cfg.validate()?;
    if let Some(f) = &cfg.family {
        f.validate(&cfg)?;
    }
    Ok(cfg)
}

/// The fields every family shares, and the V4-only ones neutral.
fn shared(r: &Reader, head_dim: usize, rope_dim: usize, rope_theta: f64) -> Result<ModelConfig> {
    shared_with(
        r,
        head_dim,
        rope_dim,
        rope_theta,
        &["moe_intermediate_size"],
    )
}

/// [`shared`] with the spellings of the routed experts' width (`intermediate_size` on gpt-oss).
fn shared_with(
    r: &Reader,
    head_dim: usize,
    rope_dim: usize,
    rope_theta: f64,
    moe_keys: &[&'static str],
) -> Result<ModelConfig> {
    let hidden_size = r.usize(&["hidden_size"], None, &limits::HIDDEN_SIZE)?;
    let num_hidden_layers = r.usize(&["num_hidden_layers"], None, &limits::NUM_HIDDEN_LAYERS)?;
    Ok(ModelConfig {
        hidden_size,
        num_hidden_layers,
        vocab_size: r.usize(&["vocab_size"], None, &limits::VOCAB_SIZE)?,
        num_attention_heads: r.usize(
            &["num_attention_heads"],
            None,
            &limits::NUM_ATTENTION_HEADS,
        )?,
        head_dim,
        qk_rope_head_dim: rope_dim,
        q_lora_rank: hidden_size,
        o_groups: 1,
        o_lora_rank: 1,
        sliding_window: limits::SLIDING_WINDOW.max as usize,
        compress_ratios: vec![0; num_hidden_layers],
        rope_theta,
        compress_rope_theta: rope_theta,
        yarn: None,
        rms_norm_eps: r.float("rms_norm_eps", 1e-6, Sign::NonNegative)?,
        hc_mult: 1,
        hc_sinkhorn_iters: 0,
        hc_eps: 0.0,
        n_routed_experts: r.usize(
            &["num_experts", "num_local_experts", "n_routed_experts"],
            None,
            &limits::N_ROUTED_EXPERTS,
        )?,
        num_experts_per_tok: r.usize(
            &["num_experts_per_tok", "experts_per_token"],
            None,
            &limits::NUM_EXPERTS_PER_TOK,
        )?,
        n_shared_experts: 0,
        moe_intermediate_size: r.usize(moe_keys, None, &limits::MOE_INTERMEDIATE_SIZE)?,
        num_hash_layers: 0,
        routed_scaling_factor: 1.0,
        norm_topk_prob: false,
        scoring_func: "softmax".into(),
        swiglu_limit: 0.0,
        index_n_heads: 1,
        index_head_dim: 2,
        index_topk: 1,
        family: None,
    })
}

fn qwen3_moe(v: &Value) -> Result<ModelConfig> {
    let r = Reader { v };
    let hidden = r.usize(&["hidden_size"], None, &limits::HIDDEN_SIZE)?;
    let heads = r.usize(&["num_attention_heads"], None, &limits::NUM_ATTENTION_HEADS)?;
    let head_dim = r.usize(&["head_dim"], Some(hidden / heads), &limits::HEAD_DIM)?;
    let (theta, ty) = rope_theta(&r, 10000.0)?;
    if let Some(t) = ty.filter(|t| t != "default") {
        return Err(Error::usage(format!(
            "config field `rope_parameters.rope_type` = `{t}`: this tool reads Qwen3-MoE with the default rope only"
        )));
    }
    if r.bool("attention_bias", false)? {
        return Err(Error::usage(
            "config field `attention_bias` is true: Qwen3-MoE's projections have no bias in this tool",
        ));
    }
    let mut cfg = shared(&r, head_dim, head_dim, theta)?;
    cfg.norm_topk_prob = r.bool("norm_topk_prob", false)?;
    let n = cfg.num_hidden_layers;
    let step = r.usize(&["decoder_sparse_step"], Some(1), &DECODER_SPARSE_STEP)?;
    let mut dense: Vec<bool> = (0..n).map(|i| (i + 1) % step != 0).collect();
    if let Some(m) = r.get("mlp_only_layers") {
        let arr = m
            .as_array()
            .ok_or_else(|| Error::usage("config field `mlp_only_layers` is not an array"))?;
        for x in arr {
            let i = x.as_u64().filter(|&i| (i as usize) < n).ok_or_else(|| {
                Error::usage(format!(
                    "config field `mlp_only_layers` entry {x} is not a layer index below {n}"
                ))
            })?;
            dense[i as usize] = true;
        }
    }
    let intermediate_size = if dense.iter().any(|&d| d) {
        r.usize(&["intermediate_size"], None, &INTERMEDIATE_SIZE)?
    } else {
        0
    };
    cfg.family = Some(Family {
        kind: Kind::Qwen3Moe,
        num_key_value_heads: r.usize(
            &["num_key_value_heads"],
            Some(heads),
            &NUM_KEY_VALUE_HEADS,
        )?,
        v_head_dim: head_dim,
        rope_style: RopeStyle::HalfSplit,
        rope_attention_factor: 1.0,
        dense,
        intermediate_size,
        separate_head: !r.bool("tie_word_embeddings", false)?,
        attn_scale: (head_dim as f64).powf(-0.5),
        q_lora_rank: None,
        kv_lora_rank: 0,
        n_group: 1,
        topk_group: 1,
        router_logits_stored: true,
        sliding: Vec::new(),
        attention_bias: false,
        sinks: false,
        router_logit_bias: false,
        linear_experts: false,
    });
    Ok(cfg)
}

const KV_LORA_RANK: Range = Range {
    field: "kv_lora_rank",
    min: 1,
    max: 1 << 16,
    why: "the MLA key/value latent; V3 has 512",
};
const N_GROUP: Range = Range {
    field: "n_group",
    min: 1,
    max: 4096,
    why: "expert groups of the group-limited router; V3 has 8",
};

fn deepseek_v3(v: &Value) -> Result<ModelConfig> {
    let r = Reader { v };
    let nope = r.usize(&["qk_nope_head_dim"], None, &limits::HEAD_DIM)?;
    let rope = r.usize(&["qk_rope_head_dim"], None, &limits::QK_ROPE_HEAD_DIM)?;
    let head_dim = limits::HEAD_DIM.check((nope + rope) as u64)?;
    let v_head_dim = r.usize(&["v_head_dim"], None, &limits::HEAD_DIM)?;
    let q_lora_rank = match r.get("q_lora_rank") {
        None => None,
        Some(_) => Some(r.usize(&["q_lora_rank"], None, &limits::Q_LORA_RANK)?),
    };
    let kv_lora_rank = r.usize(&["kv_lora_rank"], None, &KV_LORA_RANK)?;
    let (theta, ty) = rope_theta(&r, 10000.0)?;
    let params = r.get("rope_parameters").or_else(|| r.get("rope_scaling"));
    let mut attn_scale = (head_dim as f64).powf(-0.5);
    let mut rope_factor = 1.0;
    let yarn = match ty.as_deref() {
        None | Some("default") => None,
        Some("yarn") => {
            let p = params.unwrap_or(&Value::Null);
            let f = |k: &str, d: f64| rope_param(p, k, d);
            let y = super::super::config::Yarn {
                factor: f("factor", 1.0)?,
                original_max_position_embeddings: f("original_max_position_embeddings", 4096.0)?,
                beta_fast: f("beta_fast", 32.0)?,
                beta_slow: f("beta_slow", 1.0)?,
                truncate: true,
            };
            // DeepseekV3Attention: softmax scale × mscale(factor, mscale_all_dim)²
            let all_dim = match p.get("mscale_all_dim").filter(|x| !x.is_null()) {
                Some(_) => f("mscale_all_dim", 0.0)?,
                None => 0.0,
            };
            let ms = |m: f64| {
                if y.factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * y.factor.ln() + 1.0
                }
            };
            if all_dim > 0.0 {
                attn_scale *= ms(all_dim) * ms(all_dim);
            }
            // transformers' YaRN attention factor on cos/sin: mscale(mscale)/mscale(mscale_all_dim)
            let mscale = match p.get("mscale").filter(|x| !x.is_null()) {
                Some(_) => f("mscale", 1.0)?,
                None => 0.0,
            };
            rope_factor = if mscale > 0.0 && all_dim > 0.0 {
                ms(mscale) / ms(all_dim)
            } else {
                ms(1.0)
            };
            Some(y)
        }
        Some(t) => {
            return Err(Error::usage(format!(
                "config field `rope_parameters.rope_type` = `{t}`: this tool reads DeepSeek-V3 with the default or YaRN rope"
            )))
        }
    };
    let mut cfg = shared(&r, head_dim, rope, theta)?;
    cfg.yarn = yarn;
    cfg.q_lora_rank = q_lora_rank.unwrap_or(cfg.hidden_size);
    cfg.n_shared_experts = r.usize(&["n_shared_experts"], Some(1), &limits::N_SHARED_EXPERTS)?;
    cfg.norm_topk_prob = r.bool("norm_topk_prob", true)?;
    cfg.routed_scaling_factor = r.float("routed_scaling_factor", 1.0, Sign::Any)?;
    let scoring = limits::str_field("scoring_func", r.get("scoring_func"), None)?;
    let scoring = scoring.as_deref().unwrap_or("sigmoid");
    if scoring != "sigmoid" {
        return Err(Error::usage(format!(
            "config field `scoring_func` = `{scoring}`: DeepSeek-V3 routes on sigmoid scores"
        )));
    }
    cfg.scoring_func = "sigmoid".into();
    let n = cfg.num_hidden_layers;
    let first_dense = r.usize(
        &["first_k_dense_replace"],
        Some(0),
        &Range {
            field: "first_k_dense_replace",
            min: 0,
            max: n as u64,
            why: "leading dense layers, at most the layers there are; V3 has 3",
        },
    )?;
    let freq = r.usize(&["moe_layer_freq"], Some(1), &DECODER_SPARSE_STEP)?;
    let dense: Vec<bool> = (0..n).map(|i| i < first_dense || i % freq != 0).collect();
    let intermediate_size = if dense.iter().any(|&d| d) {
        r.usize(&["intermediate_size"], None, &INTERMEDIATE_SIZE)?
    } else {
        0
    };
    let heads = cfg.num_attention_heads;
    let n_group = r.usize(&["n_group"], Some(1), &N_GROUP)?;
    let topk_group = r.usize(
        &["topk_group"],
        Some(n_group),
        &Range {
            field: "topk_group",
            min: 1,
            max: n_group as u64,
            why: "groups kept, at most `n_group`",
        },
    )?;
    if !cfg.n_routed_experts.is_multiple_of(n_group) || cfg.n_routed_experts / n_group < 2 {
        return Err(Error::usage(format!(
            "config field `n_group` = {n_group}: `n_routed_experts` {} must split into groups of at least 2",
            cfg.n_routed_experts
        )));
    }
    if topk_group * (cfg.n_routed_experts / n_group) < cfg.num_experts_per_tok {
        return Err(Error::usage(format!(
            "config field `topk_group` = {topk_group}: its groups hold fewer experts than `num_experts_per_tok` {}",
            cfg.num_experts_per_tok
        )));
    }
    cfg.family = Some(Family {
        kind: Kind::DeepseekV3,
        num_key_value_heads: heads,
        v_head_dim,
        rope_style: if r.bool("rope_interleave", true)? {
            RopeStyle::Interleaved
        } else {
            RopeStyle::HalfSplit
        },
        rope_attention_factor: rope_factor,
        dense,
        intermediate_size,
        separate_head: !r.bool("tie_word_embeddings", false)?,
        attn_scale,
        q_lora_rank,
        kv_lora_rank,
        n_group,
        topk_group,
        // transformers casts the gate to FP32, but under autocast and in vLLM/SGLang the gate
        // runs in the activation dtype: the BF16 paths round the logits as served
        router_logits_stored: true,
        sliding: Vec::new(),
        attention_bias: false,
        sinks: false,
        router_logit_bias: false,
        linear_experts: false,
    });
    Ok(cfg)
}

/// A positive number of the rope's parameters, `d` when absent; errors name the field.
fn rope_param(p: &Value, k: &str, d: f64) -> Result<f64> {
    match p.get(k).filter(|x| !x.is_null()) {
        Some(x) => {
            let field = format!("rope_parameters.{k}");
            let f = x.as_f64().ok_or_else(|| {
                Error::usage(format!("config field `{field}` is not a number: {x}"))
            })?;
            limits::check_float(&field, f, Sign::Positive)
        }
        None => Ok(d),
    }
}

impl Family {
    /// Constraints between fields the family's math relies on.
    pub fn validate(&self, cfg: &ModelConfig) -> Result<()> {
        let kv = self.num_key_value_heads;
        NUM_KEY_VALUE_HEADS.check(kv as u64)?;
        if !cfg.num_attention_heads.is_multiple_of(kv) {
            return Err(Error::usage(format!(
                "config field `num_attention_heads` = {} is not divisible by `num_key_value_heads` {kv}",
                cfg.num_attention_heads
            )));
        }
        limits::HEAD_DIM.check(self.v_head_dim as u64)?;
        if self.dense.len() != cfg.num_hidden_layers {
            return Err(Error::usage(format!(
                "config: {} dense/sparse entries for {} layers",
                self.dense.len(),
                cfg.num_hidden_layers
            )));
        }
        if self.dense.iter().any(|&d| d) {
            INTERMEDIATE_SIZE.check(self.intermediate_size as u64)?;
        }
        if !self.sliding.is_empty() && self.sliding.len() != cfg.num_hidden_layers {
            return Err(Error::usage(format!(
                "config: {} sliding/full entries for {} layers",
                self.sliding.len(),
                cfg.num_hidden_layers
            )));
        }
        Ok(())
    }

    /// Key/value heads per query head group.
    pub fn group(&self, cfg: &ModelConfig) -> usize {
        cfg.num_attention_heads / self.num_key_value_heads.max(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn qwen() -> Value {
        json!({
            "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "hidden_size": 128, "num_hidden_layers": 3, "vocab_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64,
            "norm_topk_prob": true, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6
        })
    }

    fn err(f: impl FnOnce(&mut Value)) -> String {
        let mut v = qwen();
        f(&mut v);
        ModelConfig::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn qwen3_moe_is_detected_and_read() {
        let c = ModelConfig::from_json(&qwen()).unwrap();
        let f = c.family.as_ref().unwrap();
        assert_eq!(f.kind, Kind::Qwen3Moe);
        assert_eq!((c.head_dim, f.num_key_value_heads, f.group(&c)), (32, 2, 2));
        assert_eq!((c.n_routed_experts, c.num_experts_per_tok), (8, 2));
        assert_eq!(c.rope_theta, 1e6);
        assert!(c.norm_topk_prob && f.separate_head && !f.dense.iter().any(|&d| d));
        // transformers 5 spelling
        let mut v = qwen();
        let o = v.as_object_mut().unwrap();
        o.remove("num_experts");
        o.remove("rope_theta");
        o.insert("num_local_experts".into(), json!(8));
        o.insert(
            "rope_parameters".into(),
            json!({"rope_theta": 5e5, "rope_type": "default"}),
        );
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!((c.n_routed_experts, c.rope_theta), (8, 5e5));
    }

    #[test]
    fn refusals_name_the_field() {
        let e = err(|v| v["num_key_value_heads"] = json!(3));
        assert!(e.contains("`num_key_value_heads` 3"), "{e}");
        let e = err(|v| v["num_key_value_heads"] = json!(0));
        assert!(e.contains("`num_key_value_heads` = 0"), "{e}");
        let e = err(|v| {
            v.as_object_mut().unwrap().remove("num_experts");
            v["num_local_experts"] = json!(1u64 << 40);
        });
        assert!(e.contains("`num_local_experts`"), "{e}");
        let e = err(|v| v["num_experts_per_tok"] = json!(9));
        assert!(e.contains("`num_experts_per_tok`"), "{e}");
        let e = err(|v| v["mlp_only_layers"] = json!([5]));
        assert!(e.contains("`mlp_only_layers`"), "{e}");
        let e = err(|v| v["mlp_only_layers"] = json!([1]));
        assert!(e.contains("`intermediate_size` is missing"), "{e}");
        let e = err(|v| v["rope_scaling"] = json!({"rope_type": "yarn", "factor": 4.0}));
        assert!(e.contains("rope_type"), "{e}");
        let e = err(|v| v["rms_norm_eps"] = json!(-1.0));
        assert!(e.contains("`rms_norm_eps`"), "{e}");
        let e = err(|v| v["head_dim"] = json!(1));
        assert!(e.contains("`head_dim`"), "{e}");
    }

    fn v3() -> Value {
        json!({
            "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
            "hidden_size": 128, "num_hidden_layers": 3, "vocab_size": 256,
            "num_attention_heads": 4, "q_lora_rank": 64, "kv_lora_rank": 32,
            "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
            "moe_intermediate_size": 64, "intermediate_size": 256, "first_k_dense_replace": 1,
            "n_group": 4, "topk_group": 2, "routed_scaling_factor": 2.5,
            "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
            "rope_theta": 10000.0
        })
    }

    #[test]
    fn deepseek_v3_is_read_with_its_yarn_scale() {
        let c = ModelConfig::from_json(&v3()).unwrap();
        let f = c.family.as_ref().unwrap();
        assert_eq!(f.kind, Kind::DeepseekV3);
        assert_eq!((c.head_dim, c.qk_rope_head_dim, f.v_head_dim), (48, 16, 32));
        assert_eq!((f.q_lora_rank, f.kv_lora_rank), (Some(64), 32));
        assert_eq!(f.dense, vec![true, false, false]);
        assert_eq!((f.n_group, f.topk_group, c.n_shared_experts), (4, 2, 1));
        // mscale(40, 1)² on the softmax scale; mscale/mscale_all_dim = 1 on cos/sin
        let m = 0.1 * 40f64.ln() + 1.0;
        assert!((f.attn_scale - m * m / 48f64.sqrt()).abs() < 1e-12);
        assert_eq!(f.rope_attention_factor, 1.0);
        assert_eq!(c.yarn.as_ref().unwrap().factor, 40.0);
        assert_eq!(f.rope_style, RopeStyle::Interleaved);
        // V2-Lite style: no query LoRA
        let mut v = v3();
        v["q_lora_rank"] = Value::Null;
        assert_eq!(
            ModelConfig::from_json(&v)
                .unwrap()
                .family
                .unwrap()
                .q_lora_rank,
            None
        );
    }

    #[test]
    fn deepseek_v3_refusals_name_the_field() {
        let e = |f: &dyn Fn(&mut Value)| {
            let mut v = v3();
            f(&mut v);
            ModelConfig::from_json(&v).unwrap_err().to_string()
        };
        let m = e(&|v| v["topk_group"] = json!(5));
        assert!(m.contains("`topk_group`"), "{m}");
        let m = e(&|v| v["n_group"] = json!(3));
        assert!(m.contains("`n_group`"), "{m}");
        let m = e(&|v| v["first_k_dense_replace"] = json!(4));
        assert!(m.contains("`first_k_dense_replace`"), "{m}");
        let m = e(&|v| v["kv_lora_rank"] = json!(0));
        assert!(m.contains("`kv_lora_rank`"), "{m}");
        let m = e(&|v| v["scoring_func"] = json!("softmax"));
        assert!(m.contains("`scoring_func`"), "{m}");
        // values of the wrong type are refused, not read as the default (issue 44)
        let m = e(&|v| v["scoring_func"] = json!(5));
        assert!(m.contains("`scoring_func` is not a string"), "{m}");
        let m = e(&|v| v["rope_scaling"]["type"] = json!(3));
        assert!(m.contains("`rope_scaling.type` is not a string"), "{m}");
        let m = e(&|v| v["norm_topk_prob"] = json!("false"));
        assert!(m.contains("`norm_topk_prob` is not a boolean"), "{m}");
        let m = e(&|v| v["rope_scaling"]["factor"] = json!(-1));
        assert!(m.contains("`rope_parameters.factor`"), "{m}");
        let m = e(&|v| {
            v.as_object_mut().unwrap().remove("v_head_dim");
        });
        assert!(m.contains("`v_head_dim` is missing"), "{m}");
    }

    #[test]
    fn dense_layers_follow_the_sparse_step_and_the_list() {
        let mut v = qwen();
        v["decoder_sparse_step"] = json!(2);
        v["mlp_only_layers"] = json!([2]);
        v["intermediate_size"] = json!(256);
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.family.unwrap().dense, vec![true, false, true]);
    }
}
