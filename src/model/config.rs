//! `config.json` of a DeepSeek-V4 checkpoint, in either spelling: the official hub config
//! (`compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, flat `rope_scaling`) or the
//! transformers one (`layer_types` + `compress_rates`, `mlp_layer_types`,
//! `partial_rotary_factor`, nested `rope_parameters = {main, compress}`).

use serde_json::Value;
use std::path::Path;

use crate::{Error, Result};

/// YaRN parameters of the compressed layers' RoPE (DSV4-LAYER.md §3.4).
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Yarn {
    pub factor: f64,
    pub original_max_position_embeddings: f64,
    pub beta_fast: f64,
    pub beta_slow: f64,
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
}

fn get<'a>(v: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter().find_map(|k| v.get(*k).filter(|x| !x.is_null()))
}

impl ModelConfig {
    /// Read and parse `DIR/config.json`; errors name the file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| Error::bad(path, None, format!("config is not valid JSON: {e}")))?;
        Self::from_json(&v).map_err(|e| match e {
            Error::Usage(m) => Error::bad(path, None, m),
            other => other,
        })
    }

    /// Parse a config value. Errors are `Error::Usage` with the field named (callers attach the file).
    pub fn from_json(v: &Value) -> Result<Self> {
        if !v.is_object() {
            return Err(Error::usage("config is not a JSON object"));
        }
        let us = |keys: &[&str], default: Option<usize>| -> Result<usize> {
            match get(v, keys) {
                Some(x) => x.as_u64().map(|n| n as usize).ok_or_else(|| {
                    Error::usage(format!(
                        "config field `{}` is not a non-negative integer: {x}",
                        keys[0]
                    ))
                }),
                None => default
                    .ok_or_else(|| Error::usage(format!("config field `{}` is missing", keys[0]))),
            }
        };
        let fl = |keys: &[&str], default: Option<f64>| -> Result<f64> {
            match get(v, keys) {
                Some(x) => x.as_f64().ok_or_else(|| {
                    Error::usage(format!("config field `{}` is not a number: {x}", keys[0]))
                }),
                None => default
                    .ok_or_else(|| Error::usage(format!("config field `{}` is missing", keys[0]))),
            }
        };
        let hidden_size = us(&["hidden_size", "dim"], None)?;
        let num_hidden_layers = us(&["num_hidden_layers", "n_layers"], None)?;
        let head_dim = us(&["head_dim"], Some(512))?;
        let qk_rope_head_dim = match get(v, &["qk_rope_head_dim", "rope_head_dim"]) {
            Some(_) => us(&["qk_rope_head_dim", "rope_head_dim"], None)?,
            None => match get(v, &["partial_rotary_factor"]).and_then(Value::as_f64) {
                Some(f) => (head_dim as f64 * f).round() as usize,
                None => 64,
            },
        };

        // Attention schedule.
        let compress_ratios: Vec<usize> = if let Some(arr) = get(v, &["compress_ratios"]) {
            let arr = arr
                .as_array()
                .ok_or_else(|| Error::usage("config field `compress_ratios` is not an array"))?;
            let mut out = Vec::new();
            for x in arr {
                out.push(x.as_u64().ok_or_else(|| {
                    Error::usage(format!("`compress_ratios` entry is not an integer: {x}"))
                })? as usize);
            }
            if out.len() < num_hidden_layers {
                return Err(Error::usage(format!(
                    "`compress_ratios` has {} entries for {} layers",
                    out.len(),
                    num_hidden_layers
                )));
            }
            out.truncate(num_hidden_layers);
            out
        } else if let Some(lt) = get(v, &["layer_types"]) {
            let rates = get(v, &["compress_rates"]);
            let rate = |name: &str, d: usize| {
                rates
                    .and_then(|r| r.get(name))
                    .and_then(Value::as_u64)
                    .map(|x| x as usize)
                    .unwrap_or(d)
            };
            let lt = lt
                .as_array()
                .ok_or_else(|| Error::usage("config field `layer_types` is not an array"))?;
            let mut out = Vec::new();
            for t in lt.iter().take(num_hidden_layers) {
                out.push(match t.as_str() {
                    Some("sliding_attention") => 0,
                    Some("compressed_sparse_attention") => rate("compressed_sparse_attention", 4),
                    Some("heavily_compressed_attention") => {
                        rate("heavily_compressed_attention", 128)
                    }
                    _ => return Err(Error::usage(format!("unknown layer type {t}"))),
                });
            }
            if out.len() < num_hidden_layers {
                return Err(Error::usage(format!(
                    "`layer_types` has {} entries for {} layers",
                    out.len(),
                    num_hidden_layers
                )));
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

        let num_hash_layers =
            if let Some(m) = get(v, &["mlp_layer_types"]).and_then(Value::as_array) {
                m.iter()
                    .take_while(|t| t.as_str() == Some("hash_moe"))
                    .count()
            } else {
                us(&["num_hash_layers"], Some(3))?
            };

        // RoPE: flat rope_scaling (official) or nested rope_parameters.compress (HF).
        let rope_theta = match get(v, &["rope_parameters"])
            .and_then(|r| r.get("main"))
            .and_then(|m| m.get("rope_theta"))
        {
            Some(x) => x.as_f64().unwrap_or(10000.0),
            None => fl(&["rope_theta"], Some(10000.0))?,
        };
        let compress = get(v, &["rope_parameters"]).and_then(|r| r.get("compress"));
        let compress_rope_theta = match compress.and_then(|c| c.get("rope_theta")) {
            Some(x) => x.as_f64().unwrap_or(160000.0),
            None => fl(&["compress_rope_theta"], Some(160000.0))?,
        };
        let yarn_src = compress
            .filter(|c| {
                c.get("rope_type").or(c.get("type")).and_then(Value::as_str) == Some("yarn")
            })
            .or_else(|| {
                get(v, &["rope_scaling"]).filter(|c| {
                    c.get("rope_type").or(c.get("type")).and_then(Value::as_str) == Some("yarn")
                })
            });
        let yarn = yarn_src.map(|y| Yarn {
            factor: y.get("factor").and_then(Value::as_f64).unwrap_or(16.0),
            original_max_position_embeddings: y
                .get("original_max_position_embeddings")
                .and_then(Value::as_f64)
                .unwrap_or(65536.0),
            beta_fast: y.get("beta_fast").and_then(Value::as_f64).unwrap_or(32.0),
            beta_slow: y.get("beta_slow").and_then(Value::as_f64).unwrap_or(1.0),
        });

        let cfg = ModelConfig {
            hidden_size,
            num_hidden_layers,
            vocab_size: us(&["vocab_size"], None)?,
            num_attention_heads: us(&["num_attention_heads", "n_heads"], None)?,
            head_dim,
            qk_rope_head_dim,
            q_lora_rank: us(&["q_lora_rank"], None)?,
            o_groups: us(&["o_groups"], None)?,
            o_lora_rank: us(&["o_lora_rank"], None)?,
            sliding_window: us(&["sliding_window", "window_size"], Some(128))?,
            compress_ratios,
            rope_theta,
            compress_rope_theta,
            yarn,
            rms_norm_eps: fl(&["rms_norm_eps", "norm_eps"], Some(1e-6))?,
            hc_mult: us(&["hc_mult"], Some(4))?,
            hc_sinkhorn_iters: us(&["hc_sinkhorn_iters"], Some(20))?,
            hc_eps: fl(&["hc_eps"], Some(1e-6))?,
            n_routed_experts: us(&["n_routed_experts", "num_local_experts"], None)?,
            num_experts_per_tok: us(&["num_experts_per_tok", "n_activated_experts"], None)?,
            n_shared_experts: us(&["n_shared_experts"], Some(1))?,
            moe_intermediate_size: us(&["moe_intermediate_size", "moe_inter_dim"], None)?,
            num_hash_layers,
            routed_scaling_factor: fl(&["routed_scaling_factor", "route_scale"], Some(1.0))?,
            norm_topk_prob: get(v, &["norm_topk_prob"])
                .and_then(Value::as_bool)
                .unwrap_or(true),
            scoring_func: get(v, &["scoring_func", "score_func"])
                .and_then(Value::as_str)
                .unwrap_or("sqrtsoftplus")
                .to_string(),
            swiglu_limit: fl(&["swiglu_limit"], Some(10.0))?,
            index_n_heads: us(&["index_n_heads"], Some(64))?,
            index_head_dim: us(&["index_head_dim"], Some(128))?,
            index_topk: us(&["index_topk"], Some(512))?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Structural constraints the layer math relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::usage(m));
        if self.hidden_size == 0 || self.num_attention_heads == 0 || self.head_dim == 0 {
            return bad(
                "config: hidden_size, num_attention_heads and head_dim must be positive".into(),
            );
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) || self.qk_rope_head_dim > self.head_dim {
            return bad(format!(
                "config: qk_rope_head_dim {} must be even and ≤ head_dim {}",
                self.qk_rope_head_dim, self.head_dim
            ));
        }
        if self.o_groups == 0 || !self.num_attention_heads.is_multiple_of(self.o_groups) {
            return bad(format!(
                "config: num_attention_heads {} not divisible by o_groups {}",
                self.num_attention_heads, self.o_groups
            ));
        }
        if self.num_experts_per_tok == 0 || self.num_experts_per_tok > self.n_routed_experts {
            return bad(format!(
                "config: num_experts_per_tok {} must be in 1..={}",
                self.num_experts_per_tok, self.n_routed_experts
            ));
        }
        for (i, r) in self.compress_ratios.iter().enumerate() {
            if ![0, 4, 128].contains(r) && *r != 0 && (*r < 2) {
                return bad(format!(
                    "config: compress ratio {r} of layer {i} unsupported"
                ));
            }
        }
        if self.hc_mult == 0 {
            return bad("config: hc_mult must be positive".into());
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
