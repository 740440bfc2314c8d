//! gpt-oss's `config.json` (transformers' `GptOssConfig`, as the openai/gpt-oss-* releases and
//! `save_pretrained` write it), read with the family parser's limits (`super`).

use serde_json::Value;

use super::super::super::limits::{self, Sign};
use super::super::kind::{Family, Kind, RopeStyle};
use super::{rope_param, rope_theta, shared_with, Reader, NUM_KEY_VALUE_HEADS};
use crate::model::ModelConfig;
use crate::{Error, Result};

/// gpt-oss (`GptOssConfig`, the openai/gpt-oss-* releases): GQA with biases and sinks,
/// `layer_types` alternating sliding and full attention, YaRN with `truncate` read, routed experts
/// only (`num_local_experts` of `intermediate_size`), the clamped GLU's limit (transformers fixes
/// it at 7; the releases' `swiglu_limit` says the same).
pub(super) fn gpt_oss(v: &Value) -> Result<ModelConfig> {
    let r = Reader { v };
    let hidden = r.usize(&["hidden_size"], None, &limits::HIDDEN_SIZE)?;
    let heads = r.usize(&["num_attention_heads"], None, &limits::NUM_ATTENTION_HEADS)?;
    let head_dim = r.usize(&["head_dim"], Some(hidden / heads), &limits::HEAD_DIM)?;
    if !head_dim.is_multiple_of(2) {
        return Err(Error::usage(format!(
            "config field `head_dim` = {head_dim} must be even (the rope rotates pairs)"
        )));
    }
    let (theta, ty) = rope_theta(&r, 150000.0)?;
    let params = r.get("rope_parameters").or_else(|| r.get("rope_scaling"));
    let (yarn, rope_factor) = match ty.as_deref() {
        None | Some("default") => (None, 1.0),
        Some("yarn") => {
            let p = params.unwrap_or(&Value::Null);
            let truncate = limits::bool_field("rope_parameters.truncate", p.get("truncate"), true)?;
            let y = super::super::super::config::Yarn {
                factor: rope_param(p, "factor", 1.0)?,
                original_max_position_embeddings: rope_param(
                    p,
                    "original_max_position_embeddings",
                    4096.0,
                )?,
                beta_fast: rope_param(p, "beta_fast", 32.0)?,
                beta_slow: rope_param(p, "beta_slow", 1.0)?,
                truncate,
            };
            // transformers: `attention_factor` if given, else 0.1·ln(factor) + 1 (factor > 1)
            let a = match p.get("attention_factor").filter(|x| !x.is_null()) {
                Some(_) => rope_param(p, "attention_factor", 1.0)?,
                None if y.factor > 1.0 => 0.1 * y.factor.ln() + 1.0,
                None => 1.0,
            };
            (Some(y), a)
        }
        Some(t) => {
            return Err(Error::usage(format!(
                "config field `rope_parameters.rope_type` = `{t}`: this tool reads gpt-oss with the default or YaRN rope"
            )))
        }
    };
    let mut cfg = shared_with(&r, head_dim, head_dim, theta, &["intermediate_size"])?;
    cfg.yarn = yarn;
    cfg.rms_norm_eps = r.float("rms_norm_eps", 1e-5, Sign::NonNegative)?;
    cfg.norm_topk_prob = true;
    cfg.swiglu_limit = r.float("swiglu_limit", 7.0, Sign::Positive)?;
    let n = cfg.num_hidden_layers;
    let sliding: Vec<bool> = match r.get("layer_types") {
        // GptOssConfig's default: even layers slide
        None => (0..n).map(|i| i % 2 == 0).collect(),
        Some(x) => {
            let arr = x
                .as_array()
                .ok_or_else(|| Error::usage("config field `layer_types` is not an array"))?;
            if arr.len() != n {
                return Err(Error::usage(format!(
                    "config field `layer_types` has {} entries for {n} layers (`num_hidden_layers`)",
                    arr.len()
                )));
            }
            arr.iter()
                .enumerate()
                .map(|(i, t)| match t.as_str() {
                    Some("sliding_attention") => Ok(true),
                    Some("full_attention") => Ok(false),
                    _ => Err(Error::usage(format!(
                        "config field `layer_types` entry {i} is {t}, not \"sliding_attention\" or \"full_attention\""
                    ))),
                })
                .collect::<Result<_>>()?
        }
    };
    if sliding.iter().any(|&s| s) {
        cfg.sliding_window = r.usize(&["sliding_window"], None, &limits::SLIDING_WINDOW)?;
    }
    cfg.family = Some(Family {
        kind: Kind::GptOss,
        num_key_value_heads: r.usize(
            &["num_key_value_heads"],
            Some(heads),
            &NUM_KEY_VALUE_HEADS,
        )?,
        v_head_dim: head_dim,
        rope_style: RopeStyle::HalfSplit,
        rope_attention_factor: rope_factor,
        dense: vec![false; n],
        intermediate_size: 0,
        separate_head: !r.bool("tie_word_embeddings", false)?,
        attn_scale: (head_dim as f64).powf(-0.5),
        q_lora_rank: None,
        kv_lora_rank: 0,
        n_group: 1,
        topk_group: 1,
        // the router is an nn.Linear run in the activation dtype
        router_logits_stored: true,
        sliding,
        attention_bias: r.bool("attention_bias", true)?,
        sinks: true,
        router_logit_bias: true,
        linear_experts: false,
    });
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn oss() -> Value {
        json!({
            "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
            "hidden_size": 128, "num_hidden_layers": 4, "vocab_size": 256,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
            "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 64,
            "sliding_window": 16, "rms_norm_eps": 1e-5,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                "beta_fast": 32.0, "beta_slow": 1.0, "truncate": false,
                "original_max_position_embeddings": 4096}
        })
    }

    fn err(f: impl FnOnce(&mut Value)) -> String {
        let mut v = oss();
        f(&mut v);
        ModelConfig::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn gpt_oss_is_detected_and_read() {
        let c = ModelConfig::from_json(&oss()).unwrap();
        let f = c.family.as_ref().unwrap();
        assert_eq!(f.kind, Kind::GptOss);
        assert_eq!((c.head_dim, c.qk_rope_head_dim, f.group(&c)), (32, 32, 2));
        assert_eq!(
            (
                c.n_routed_experts,
                c.num_experts_per_tok,
                c.moe_intermediate_size
            ),
            (8, 2, 64)
        );
        assert_eq!(f.sliding, [true, false, true, false]);
        assert_eq!(
            (f.window(c.sliding_window, 0), f.window(c.sliding_window, 1)),
            (Some(16), None)
        );
        let y = c.yarn.as_ref().unwrap();
        assert!(!y.truncate && y.factor == 32.0 && c.rope_theta == 150000.0);
        // transformers' attention factor without `attention_factor`: 0.1 ln(32) + 1
        assert!((f.rope_attention_factor - (0.1 * 32f64.ln() + 1.0)).abs() < 1e-15);
        assert!(f.attention_bias && f.sinks && f.router_logit_bias && f.separate_head);
        assert_eq!((c.swiglu_limit, c.rms_norm_eps), (7.0, 1e-5));
        assert!(c.norm_topk_prob && !f.dense.iter().any(|&d| d));
        // the architecture alone names it too; without layer_types even layers slide
        let mut v = oss();
        let o = v.as_object_mut().unwrap();
        o.remove("model_type");
        o.remove("layer_types");
        let c = ModelConfig::from_json(&v).unwrap();
        assert_eq!(c.family.unwrap().sliding, [true, false, true, false]);
    }

    #[test]
    fn gpt_oss_refusals_name_the_field() {
        let e = err(|v| v["layer_types"][1] = json!("chunked_attention"));
        assert!(e.contains("`layer_types` entry 1"), "{e}");
        let e = err(|v| v["layer_types"] = json!(["full_attention"]));
        assert!(
            e.contains("`layer_types` has 1 entries for 4 layers"),
            "{e}"
        );
        let e = err(|v| {
            v.as_object_mut().unwrap().remove("sliding_window");
        });
        assert!(e.contains("`sliding_window` is missing"), "{e}");
        let e = err(|v| v["sliding_window"] = json!(0));
        assert!(e.contains("`sliding_window`"), "{e}");
        let e = err(|v| v["rope_parameters"]["truncate"] = json!("no"));
        assert!(e.contains("`rope_parameters.truncate`"), "{e}");
        let e = err(|v| v["rope_parameters"]["rope_type"] = json!("longrope"));
        assert!(e.contains("rope_type"), "{e}");
        let e = err(|v| v["rope_parameters"]["factor"] = json!(-2));
        assert!(e.contains("`rope_parameters.factor`"), "{e}");
        let e = err(|v| {
            v.as_object_mut().unwrap().remove("intermediate_size");
        });
        assert!(e.contains("`intermediate_size` is missing"), "{e}");
        let e = err(|v| v["num_key_value_heads"] = json!(3));
        assert!(e.contains("`num_key_value_heads` 3"), "{e}");
        let e = err(|v| v["head_dim"] = json!(33));
        assert!(e.contains("`head_dim`"), "{e}");
        let e = err(|v| v["swiglu_limit"] = json!(-7.0));
        assert!(e.contains("`swiglu_limit`"), "{e}");
    }
}
