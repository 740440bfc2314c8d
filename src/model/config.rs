//! `config.json` of a DeepSeek-V4 checkpoint, in either spelling: the official hub config
//! (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling`) or the
//! transformers one (`layer_types` + `compress_rates`, `mlp_layer_types`,
//! `partial_rotary_factor`, nested `rope_parameters = {main, compress}`).

use serde_json::Value;

use super::limits::{self, Sign};
use crate::{Error, Result};

/// YaRN parameters of the compressed layers' RoPE (docs/DSV4-LAYER.md §3.4).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
    /// Whether the correction range is rounded out to whole dims (floor/ceil, DeepSeek and
    /// transformers' default); gpt-oss's `truncate: false` keeps the fractional bounds.
    #[serde(skip_serializing_if = "is_true")]
    pub truncate: bool,
}

fn is_true(b: &bool) -> bool {
    *b
}

#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub vocab_size: usize,
    pub num_attention_heads: usize,
    pub head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub q_lora_rank: usize,
    pub o_groups: usize,
    pub o_lora_rank: usize,
    pub sliding_window: usize,
    /// One entry per main layer (0 = window only, 4 = CSA with indexer, 128 = HCA).
    pub compress_ratios: Vec<usize>,
    pub rope_theta: f64,
    pub compress_rope_theta: f64,
    /// YaRN on compressed layers; None means plain RoPE there too.
    pub yarn: Option<Yarn>,
    pub rms_norm_eps: f64,
    pub hc_mult: usize,
    pub hc_sinkhorn_iters: usize,
    pub hc_eps: f64,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub moe_intermediate_size: usize,
    pub num_hash_layers: usize,
    pub routed_scaling_factor: f64,
    pub norm_topk_prob: bool,
    pub scoring_func: String,
    pub swiglu_limit: f64,
    pub index_n_heads: usize,
    pub index_head_dim: usize,
    pub index_topk: usize,
    /// A family other than V4 (issue 23: Qwen3-MoE, …) and what it adds; `None` for V4.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub family: Option<super::family::kind::Family>,
}

/// The router scorings of `scoring_func` (`device::kern::Scoring`).
const SCORING_FUNCS: [&str; 3] = ["sqrtsoftplus", "sigmoid", "softmax"];
/// The rope types of `rope_scaling` / `rope_parameters.compress` this tool reads.
const ROPE_TYPES: [&str; 2] = ["default", "yarn"];

fn get<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| v.get(*k).filter(|x| !x.is_null()))
}

/// Parse a V4 config value ([`ModelConfig::from_json`] picks this parser when the config names
/// no other family). Errors are `Error::Usage` with the field named (callers attach the file).
/// Every field is checked against the family's limits ([`limits`]) as it is read, so nothing is
/// sized from a value outside them (the default attention schedule is built per layer, after
/// `num_hidden_layers` passed its limit).
pub(super) fn parse_v4(v: &Value) -> Result<ModelConfig> {
    let us = |keys: &[&str], default: Option<usize>, lim: &limits::Range| -> Result<usize> {
        let n = match get(v, keys) {
            Some(x) => x.as_u64().ok_or_else(|| {
                Error::usage(format!(
                    "config field `{}` is not a non-negative integer: {x}",
                    keys[0]
                ))
            })?,
            None => default
                .ok_or_else(|| Error::usage(format!("config field `{}` is missing", keys[0])))?
                as u64,
        };
        lim.check(n).map_err(|e| match e {
            // name the spelling the file used
            Error::Usage(m) if get(v, &keys[..1]).is_none() && get(v, keys).is_some() => {
                let used = keys
                    .iter()
                    .find(|k| get(v, &[k]).is_some())
                    .unwrap_or(&keys[0]);
                Error::usage(m.replacen(&format!("`{}`", keys[0]), &format!("`{used}`"), 1))
            }
            other => other,
        })
    };
    let fl = |keys: &[&str], default: Option<f64>, sign: Sign| -> Result<f64> {
        let x = match get(v, keys) {
            Some(x) => x.as_f64().ok_or_else(|| {
                Error::usage(format!("config field `{}` is not a number: {x}", keys[0]))
            })?,
            None => default
                .ok_or_else(|| Error::usage(format!("config field `{}` is missing", keys[0])))?,
        };
        limits::check_float(keys[0], x, sign)
    };
    let hidden_size = us(&["hidden_size", "dim"], None, &limits::HIDDEN_SIZE)?;
    let num_hidden_layers = us(
        &["num_hidden_layers", "n_layers"],
        None,
        &limits::NUM_HIDDEN_LAYERS,
    )?;
    let head_dim = us(&["head_dim"], Some(512), &limits::HEAD_DIM)?;
    let qk_rope_head_dim = match get(v, &["qk_rope_head_dim", "rope_head_dim"]) {
        Some(_) => us(
            &["qk_rope_head_dim", "rope_head_dim"],
            None,
            &limits::QK_ROPE_HEAD_DIM,
        )?,
        None => match get(v, &["partial_rotary_factor"]) {
            Some(f) => {
                let f = f
                    .as_f64()
                    .filter(|f| f.is_finite() && *f > 0.0 && *f <= 1.0);
                let f = f.ok_or_else(|| {
                    Error::usage(format!(
                        "config field `partial_rotary_factor` is not a number in (0, 1]: {}",
                        get(v, &["partial_rotary_factor"])
                            .cloned()
                            .unwrap_or_default()
                    ))
                })?;
                limits::QK_ROPE_HEAD_DIM.check((head_dim as f64 * f).round() as u64)?
            }
            None => 64,
        },
    };

    // Attention schedule.
    let compress_ratios: Vec<usize> = if let Some(arr) = get(v, &["compress_ratios"]) {
        let arr = arr
            .as_array()
            .ok_or_else(|| Error::usage("config field `compress_ratios` is not an array"))?;
        if arr.len() < num_hidden_layers {
            return Err(Error::usage(format!(
                "config field `compress_ratios` has {} entries for {} layers (`num_hidden_layers`)",
                arr.len(),
                num_hidden_layers
            )));
        }
        let mut out = Vec::with_capacity(num_hidden_layers);
        for (i, x) in arr.iter().take(num_hidden_layers).enumerate() {
            let r = x.as_u64().ok_or_else(|| {
                Error::usage(format!(
                    "config field `compress_ratios` entry {x} of layer {i} is not an integer"
                ))
            })?;
            out.push(limits::check_compress_ratio(i, r)?);
        }
        out
    } else if let Some(lt) = get(v, &["layer_types"]) {
        let rates = get(v, &["compress_rates"]);
        // transformers' CSA is this tool's ratio 4 (overlapping windows and the indexer);
        // an HCA rate of 4 would be read as CSA
        let rate = |name: &str, d: u64| -> Result<usize> {
            let r = match rates.and_then(|r| r.get(name)).filter(|x| !x.is_null()) {
                Some(x) => x.as_u64().ok_or_else(|| {
                    Error::usage(format!(
                        "config field `compress_rates.{name}` is not an integer: {x}"
                    ))
                })?,
                None => d,
            };
            let csa = name == "compressed_sparse_attention";
            if (csa && r != 4) || (!csa && (r == 4 || r == 0)) {
                return Err(Error::usage(format!(
                    "config field `compress_rates.{name}` = {r}: this tool reads CSA as ratio 4 and HCA as another power of two"
                )));
            }
            limits::check_compress_ratio(0, r).map_err(|_| {
                Error::usage(format!(
                    "config field `compress_rates.{name}` = {r} is not a power of two from 2 to {}",
                    limits::MAX_COMPRESS_RATIO
                ))
            })
        };
        let lt = lt
            .as_array()
            .ok_or_else(|| Error::usage("config field `layer_types` is not an array"))?;
        if lt.len() < num_hidden_layers {
            return Err(Error::usage(format!(
                "config field `layer_types` has {} entries for {} layers (`num_hidden_layers`)",
                lt.len(),
                num_hidden_layers
            )));
        }
        let mut out = Vec::with_capacity(num_hidden_layers);
        for t in lt.iter().take(num_hidden_layers) {
            out.push(match t.as_str() {
                Some("sliding_attention") => 0,
                Some("compressed_sparse_attention") => rate("compressed_sparse_attention", 4)?,
                Some("heavily_compressed_attention") => rate("heavily_compressed_attention", 128)?,
                _ => {
                    return Err(Error::usage(format!(
                        "config field `layer_types` has an unknown layer type {t}"
                    )))
                }
            });
        }
        out
    } else {
        // transformers' default schedule: 2× HCA, then CSA/HCA interleaved.
        (0..num_hidden_layers)
            .map(|i| {
                if i < 2 {
                    128
                } else if i % 2 == 0 {
                    4
                } else {
                    128
                }
            })
            .collect()
    };

    let num_hash_layers = if let Some(m) = get(v, &["mlp_layer_types"]) {
        let m = m
            .as_array()
            .ok_or_else(|| Error::usage("config field `mlp_layer_types` is not an array"))?;
        for (i, t) in m.iter().enumerate() {
            limits::typed(
                &format!("mlp_layer_types[{i}]"),
                Some(t),
                limits::Typed::Str,
            )?;
        }
        m.iter()
            .take_while(|t| t.as_str() == Some("hash_moe"))
            .count()
    } else {
        // only compared with layer indices: any count is safe, more than the layers means all
        let n = match get(v, &["num_hash_layers"]) {
            Some(x) => x.as_u64().ok_or_else(|| {
                Error::usage(format!(
                    "config field `num_hash_layers` is not a non-negative integer: {x}"
                ))
            })?,
            None => 3,
        };
        n.min(num_hidden_layers as u64) as usize
    };

    // RoPE: flat rope_scaling (official) or nested rope_parameters.compress (HF).
    let nested = |section: &str, key: &str| {
        get(v, &["rope_parameters"])
            .and_then(|r| r.get(section))
            .and_then(|m| m.get(key))
            .filter(|x| !x.is_null())
    };
    let float_at = |field: &str, x: &Value, sign: Sign| -> Result<f64> {
        let f = x
            .as_f64()
            .ok_or_else(|| Error::usage(format!("config field `{field}` is not a number: {x}")))?;
        limits::check_float(field, f, sign)
    };
    let rope_theta = match nested("main", "rope_theta") {
        Some(x) => float_at("rope_parameters.main.rope_theta", x, Sign::Positive)?,
        None => fl(&["rope_theta"], Some(10000.0), Sign::Positive)?,
    };
    let compress = get(v, &["rope_parameters"]).and_then(|r| r.get("compress"));
    let compress_rope_theta = match nested("compress", "rope_theta") {
        Some(x) => float_at("rope_parameters.compress.rope_theta", x, Sign::Positive)?,
        None => fl(&["compress_rope_theta"], Some(160000.0), Sign::Positive)?,
    };
    // the rope's type, a name this tool reads (a number or another name is refused, not read as
    // the plain rope)
    let is_yarn = |c: &Value, field: &str| -> Result<bool> {
        let key = if c.get("rope_type").is_some_and(|x| !x.is_null()) {
            "rope_type"
        } else {
            "type"
        };
        let ty = limits::str_field(&format!("{field}.{key}"), c.get(key), Some(&ROPE_TYPES))?;
        Ok(ty.as_deref() == Some("yarn"))
    };
    let compress_yarn = match compress {
        Some(c) => is_yarn(c, "rope_parameters.compress")?,
        None => false,
    };
    let (yarn_src, yarn_field) = if compress_yarn {
        (compress, "rope_parameters.compress")
    } else {
        match get(v, &["rope_scaling"]) {
            Some(s) if is_yarn(s, "rope_scaling")? => (Some(s), "rope_scaling"),
            _ => (None, "rope_scaling"),
        }
    };
    let yarn = match yarn_src {
        None => None,
        Some(y) => {
            let f = |k: &str, d: f64| -> Result<f64> {
                match y.get(k).filter(|x| !x.is_null()) {
                    Some(x) => float_at(&format!("{yarn_field}.{k}"), x, Sign::Positive),
                    None => Ok(d),
                }
            };
            Some(Yarn {
                factor: f("factor", 16.0)?,
                original_max_position_embeddings: f("original_max_position_embeddings", 65536.0)?,
                beta_fast: f("beta_fast", 32.0)?,
                beta_slow: f("beta_slow", 1.0)?,
                truncate: true,
            })
        }
    };

    let cfg = ModelConfig {
        hidden_size,
        num_hidden_layers,
        vocab_size: us(&["vocab_size"], None, &limits::VOCAB_SIZE)?,
        num_attention_heads: us(
            &["num_attention_heads", "n_heads"],
            None,
            &limits::NUM_ATTENTION_HEADS,
        )?,
        head_dim,
        qk_rope_head_dim,
        q_lora_rank: us(&["q_lora_rank"], None, &limits::Q_LORA_RANK)?,
        o_groups: us(&["o_groups"], None, &limits::O_GROUPS)?,
        o_lora_rank: us(&["o_lora_rank"], None, &limits::O_LORA_RANK)?,
        sliding_window: us(
            &["sliding_window", "window_size"],
            Some(128),
            &limits::SLIDING_WINDOW,
        )?,
        compress_ratios,
        rope_theta,
        compress_rope_theta,
        yarn,
        rms_norm_eps: fl(&["rms_norm_eps", "norm_eps"], Some(1e-6), Sign::NonNegative)?,
        hc_mult: us(&["hc_mult"], Some(4), &limits::HC_MULT)?,
        hc_sinkhorn_iters: us(&["hc_sinkhorn_iters"], Some(20), &limits::HC_SINKHORN_ITERS)?,
        hc_eps: fl(&["hc_eps"], Some(1e-6), Sign::NonNegative)?,
        n_routed_experts: us(
            &["n_routed_experts", "num_local_experts"],
            None,
            &limits::N_ROUTED_EXPERTS,
        )?,
        num_experts_per_tok: us(
            &["num_experts_per_tok", "n_activated_experts"],
            None,
            &limits::NUM_EXPERTS_PER_TOK,
        )?,
        n_shared_experts: us(&["n_shared_experts"], Some(1), &limits::N_SHARED_EXPERTS)?,
        moe_intermediate_size: us(
            &["moe_intermediate_size", "moe_inter_dim"],
            None,
            &limits::MOE_INTERMEDIATE_SIZE,
        )?,
        num_hash_layers,
        routed_scaling_factor: fl(
            &["routed_scaling_factor", "route_scale"],
            Some(1.0),
            Sign::Any,
        )?,
        norm_topk_prob: limits::bool_field("norm_topk_prob", get(v, &["norm_topk_prob"]), true)?,
        scoring_func: {
            let key = ["scoring_func", "score_func"]
                .into_iter()
                .find(|k| get(v, &[k]).is_some())
                .unwrap_or("scoring_func");
            limits::str_field(key, get(v, &[key]), Some(&SCORING_FUNCS))?
                .unwrap_or_else(|| "sqrtsoftplus".into())
        },
        swiglu_limit: fl(&["swiglu_limit"], Some(10.0), Sign::Any)?,
        index_n_heads: us(&["index_n_heads"], Some(64), &limits::INDEX_N_HEADS)?,
        index_head_dim: us(&["index_head_dim"], Some(128), &limits::INDEX_HEAD_DIM)?,
        index_topk: us(&["index_topk"], Some(512), &limits::INDEX_TOPK)?,
        family: None,
    };
    cfg.validate()?;
    Ok(cfg)
}

impl ModelConfig {
    /// Constraints between fields that the layer math relies on (each field's own range is
    /// checked as it is read; this re-checks them for configs built in code).
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::usage(m));
        for (lim, v) in [
            (limits::HIDDEN_SIZE, self.hidden_size),
            (limits::NUM_HIDDEN_LAYERS, self.num_hidden_layers),
            (limits::VOCAB_SIZE, self.vocab_size),
            (limits::NUM_ATTENTION_HEADS, self.num_attention_heads),
            (limits::HEAD_DIM, self.head_dim),
            (limits::QK_ROPE_HEAD_DIM, self.qk_rope_head_dim),
            (limits::Q_LORA_RANK, self.q_lora_rank),
            (limits::O_GROUPS, self.o_groups),
            (limits::O_LORA_RANK, self.o_lora_rank),
            (limits::SLIDING_WINDOW, self.sliding_window),
            (limits::HC_MULT, self.hc_mult),
            (limits::HC_SINKHORN_ITERS, self.hc_sinkhorn_iters),
            (limits::N_ROUTED_EXPERTS, self.n_routed_experts),
            (limits::NUM_EXPERTS_PER_TOK, self.num_experts_per_tok),
            (limits::N_SHARED_EXPERTS, self.n_shared_experts),
            (limits::MOE_INTERMEDIATE_SIZE, self.moe_intermediate_size),
            (limits::INDEX_N_HEADS, self.index_n_heads),
            (limits::INDEX_HEAD_DIM, self.index_head_dim),
            (limits::INDEX_TOPK, self.index_topk),
        ] {
            lim.check(v as u64)?;
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) || self.qk_rope_head_dim > self.head_dim {
            return bad(format!(
                "config field `qk_rope_head_dim` = {} must be even and ≤ `head_dim` {}",
                self.qk_rope_head_dim, self.head_dim
            ));
        }
        if !self.num_attention_heads.is_multiple_of(self.o_groups) {
            return bad(format!(
                "config field `num_attention_heads` = {} is not divisible by `o_groups` {}",
                self.num_attention_heads, self.o_groups
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return bad(format!(
                "config field `num_experts_per_tok` = {} must be in 1..={} (`n_routed_experts`)",
                self.num_experts_per_tok, self.n_routed_experts
            ));
        }
        if self.compress_ratios.len() < self.num_hidden_layers {
            return bad(format!(
                "config field `compress_ratios` has {} entries for {} layers",
                self.compress_ratios.len(),
                self.num_hidden_layers
            ));
        }
        for (i, r) in self.compress_ratios.iter().enumerate() {
            limits::check_compress_ratio(i, *r as u64)?;
        }
        let csa = self.compress_ratios.contains(&4);
        if csa
            && (!self.index_head_dim.is_multiple_of(2)
                || self.index_head_dim < self.qk_rope_head_dim)
        {
            return bad(format!(
                "config field `index_head_dim` = {} must be even and ≥ `qk_rope_head_dim` {} (the indexer ropes its last dims)",
                self.index_head_dim, self.qk_rope_head_dim
            ));
        }
        for (field, x, sign) in [
            ("rms_norm_eps", self.rms_norm_eps, Sign::NonNegative),
            ("hc_eps", self.hc_eps, Sign::NonNegative),
            ("rope_theta", self.rope_theta, Sign::Positive),
            (
                "compress_rope_theta",
                self.compress_rope_theta,
                Sign::Positive,
            ),
            (
                "routed_scaling_factor",
                self.routed_scaling_factor,
                Sign::Any,
            ),
            ("swiglu_limit", self.swiglu_limit, Sign::Any),
        ] {
            limits::check_float(field, x, sign)?;
        }
        Ok(())
    }

    /// Compress ratio of a layer (0, 4 or 128).
    pub fn ratio(&self, layer: usize) -> usize {
        self.compress_ratios[layer]
    }
    /// Width of the mHC mixing projection: (2 + hc) · hc.
    pub fn hc_mix(&self) -> usize {
        (2 + self.hc_mult) * self.hc_mult
    }
    pub fn is_hash_layer(&self, layer: usize) -> bool {
        layer < self.num_hash_layers
    }
    /// Non-rope part of a head.
    pub fn nope_dim(&self) -> usize {
        self.head_dim - self.qk_rope_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "hidden_size": 256, "num_hidden_layers": 3, "vocab_size": 512,
            "num_attention_heads": 4, "head_dim": 512, "qk_rope_head_dim": 64,
            "q_lora_rank": 256, "o_groups": 2, "o_lora_rank": 256,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
            "num_hash_layers": 1, "compress_ratios": [0, 128, 4], "index_topk": 8
        })
    }

    fn err(f: impl FnOnce(&mut Value)) -> String {
        let mut v = base();
        f(&mut v);
        ModelConfig::from_json(&v).unwrap_err().to_string()
    }

    #[test]
    fn the_base_config_is_valid() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.compress_ratios, vec![0, 128, 4]);
    }

    #[test]
    fn refusals_name_the_field_as_the_file_spells_it() {
        let e = err(|v| {
            v.as_object_mut().unwrap().remove("num_hidden_layers");
            v["n_layers"] = json!(0);
        });
        assert!(e.contains("`n_layers`"), "{e}");
        let e = err(|v| v["num_experts_per_tok"] = json!(9));
        assert!(
            e.contains("`num_experts_per_tok`") && e.contains("n_routed_experts"),
            "{e}"
        );
        let e = err(|v| v["compress_ratios"] = json!([0, 128]));
        assert!(
            e.contains("`compress_ratios` has 2 entries for 3 layers"),
            "{e}"
        );
        let e = err(|v| v["rope_theta"] = json!(-1.0));
        assert!(e.contains("`rope_theta`"), "{e}");
        let e = err(|v| v["rope_scaling"] = json!({"type": "yarn", "factor": 0}));
        assert!(e.contains("`rope_scaling.factor`"), "{e}");
        let e = err(|v| {
            v.as_object_mut().unwrap().remove("qk_rope_head_dim");
            v["partial_rotary_factor"] = json!(-0.5);
        });
        assert!(e.contains("`partial_rotary_factor`"), "{e}");
        // the indexer ropes its last qk_rope_head_dim dims: it must have that many
        let e = err(|v| v["index_head_dim"] = json!(32));
        assert!(e.contains("`index_head_dim`"), "{e}");
        // a value of the wrong type is refused, not read as the default (issue 44)
        let e = err(|v| v["norm_topk_prob"] = json!("false"));
        assert!(e.contains("`norm_topk_prob` is not a boolean"), "{e}");
        let e = err(|v| v["score_func"] = json!(5));
        assert!(e.contains("`score_func`"), "{e}");
        let e = err(|v| v["scoring_func"] = json!("softplus"));
        assert!(e.contains("`scoring_func` is not one of"), "{e}");
        let e = err(|v| v["rope_scaling"] = json!({"type": 3}));
        assert!(e.contains("`rope_scaling.type`"), "{e}");
        let e = err(|v| v["mlp_layer_types"] = json!("hash_moe"));
        assert!(e.contains("`mlp_layer_types`"), "{e}");
        let mut ok = base();
        ok["norm_topk_prob"] = json!(false);
        ok["score_func"] = json!("sigmoid");
        let c = ModelConfig::from_json(&ok).unwrap();
        assert!(!c.norm_topk_prob && c.scoring_func == "sigmoid");
    }

    #[test]
    fn transformers_schedules_keep_csa_at_ratio_4() {
        let hf = |rates: Value| {
            let mut v = base();
            v.as_object_mut().unwrap().remove("compress_ratios");
            v["layer_types"] = json!([
                "sliding_attention",
                "heavily_compressed_attention",
                "compressed_sparse_attention"
            ]);
            v["compress_rates"] = rates;
            ModelConfig::from_json(&v)
        };
        let c = hf(json!({"compressed_sparse_attention": 4, "heavily_compressed_attention": 64}))
            .unwrap();
        assert_eq!(c.compress_ratios, vec![0, 64, 4]);
        for bad in [
            json!({"compressed_sparse_attention": 8}),
            json!({"heavily_compressed_attention": 4}),
            json!({"heavily_compressed_attention": 100}),
            json!({"heavily_compressed_attention": "128"}),
        ] {
            let e = hf(bad.clone()).unwrap_err().to_string();
            assert!(e.contains("compress_rates."), "{bad}: {e}");
        }
    }

    #[test]
    fn hash_layers_beyond_the_model_mean_all_of_them() {
        let mut v = base();
        v["num_hash_layers"] = json!(u64::MAX);
        assert_eq!(ModelConfig::from_json(&v).unwrap().num_hash_layers, 3);
    }
}
