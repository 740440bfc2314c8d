//! Built-in maps from engines' module paths to op ids.
//!
//! A trace tensor name is `PATH` or `PATH:aux` (the capture scripts' convention). `map_name` returns the
//! op id and how the tensor is laid out relative to the op's output.

use super::mapped::layer_and_rest;
pub use super::mapped::{Mapped, PerHead, Rule, Shard, Split};

/// Hugging Face transformers' DeepseekV4ForCausalLM module paths (as written by probes/capture/hf_capture.py).
pub fn map_hf(name: &str) -> Option<Mapped> {
    let m = |op: String, token_rows: bool| Some(Mapped { op, token_rows });
    match name {
        "model.embed_tokens" => return m("embed".into(), true),
        "model.hc_head" => return m("hc_head".into(), true),
        "model.norm" => return m("final_norm".into(), true),
        "lm_head" | "logits" => return m("head".into(), true),
        _ => {}
    }
    if let Some((n, rest)) = layer_and_rest(name, "model.layers.") {
        let l = format!("L{n}");
        let op = match rest {
            "" => format!("{l}.out"),
            "attn_hc" => format!("{l}.attn.hc_pre"),
            "attn_hc:post" => format!("{l}.attn.hc_pre.post"),
            "attn_hc:comb" => format!("{l}.attn.hc_pre.comb"),
            "input_layernorm" => format!("{l}.attn.norm"),
            "self_attn.q_a_proj" => format!("{l}.attn.q_a"),
            "self_attn.kv_proj" => format!("{l}.attn.kv"),
            "self_attn.q_a_norm" => format!("{l}.attn.q_norm"),
            "self_attn.kv_norm" => format!("{l}.attn.kv_norm"),
            "self_attn.q_b_proj" => format!("{l}.attn.q_b"),
            "self_attn.compressor" => return m(format!("{l}.attn.compressor"), false),
            "self_attn.compressor.indexer" => return m(format!("{l}.attn.indexer"), false),
            "self_attn.o_a_proj:input" => format!("{l}.attn.core"),
            "self_attn.o_a_proj" => format!("{l}.attn.wo_a"),
            "self_attn.o_b_proj" | "self_attn" => format!("{l}.attn.wo_b"),
            "ffn_hc:input" => format!("{l}.attn.hc_post"),
            "ffn_hc" => format!("{l}.ffn.hc_pre"),
            "ffn_hc:post" => format!("{l}.ffn.hc_pre.post"),
            "ffn_hc:comb" => format!("{l}.ffn.hc_pre.comb"),
            "post_attention_layernorm" => format!("{l}.ffn.norm"),
            "mlp.gate" => format!("{l}.ffn.router"),
            "mlp.gate:idx" => format!("{l}.ffn.router.idx"),
            "mlp.experts" => return m(format!("{l}.ffn.experts"), false),
            "mlp.shared_experts" => format!("{l}.ffn.shared"),
            "mlp" => format!("{l}.ffn.out"),
            _ => return None,
        };
        return m(op, true);
    }
    None
}

/// Ops whose output rows are not token rows (compressed entries) or that capture scripts keep whole.
fn non_token_op(op: &str) -> bool {
    op.ends_with(".attn.compressor") || op.ends_with(".attn.indexer")
}

/// The official DeepSeek module tree (inference/model.py): `layers.N.attn.wq_a`, `layers.N.attn_norm`,
/// `layers.N.ffn.experts`, `layers.N.hc_attn` (the mHC pre of the attention side, aux `:post`/`:comb`)…
/// Tuple outputs may be written `NAME:1`, `NAME:2` as well as by their aux names.
pub fn map_official(name: &str) -> Option<Mapped> {
    let m = |op: String| {
        Some(Mapped {
            token_rows: !non_token_op(&op),
            op,
        })
    };
    match name {
        "embed" => return m("embed".into()),
        "hc_head" => return m("hc_head".into()),
        "norm" => return m("final_norm".into()),
        "head" | "logits" => return m("head".into()),
        _ => {}
    }
    let (n, rest) = layer_and_rest(name, "layers.")?;
    let l = format!("L{n}");
    let op = match rest {
        "" => format!("{l}.out"),
        "hc_attn" | "hc_attn:0" => format!("{l}.attn.hc_pre"),
        "hc_attn:post" | "hc_attn:1" => format!("{l}.attn.hc_pre.post"),
        "hc_attn:comb" | "hc_attn:2" => format!("{l}.attn.hc_pre.comb"),
        "attn_norm" => format!("{l}.attn.norm"),
        "attn.wq_a" => format!("{l}.attn.q_a"),
        "attn.wkv" => format!("{l}.attn.kv"),
        "attn.q_norm" => format!("{l}.attn.q_norm"),
        "attn.kv_norm" => format!("{l}.attn.kv_norm"),
        "attn.wq_b" => format!("{l}.attn.q_b"),
        "attn.compressor" => format!("{l}.attn.compressor"),
        "attn.indexer" => format!("{l}.attn.indexer"),
        "attn.wo_a:input" => format!("{l}.attn.core"),
        "attn.wo_a" => format!("{l}.attn.wo_a"),
        "attn.wo_b" | "attn" => format!("{l}.attn.wo_b"),
        "hc_ffn:input" => format!("{l}.attn.hc_post"),
        "hc_ffn" | "hc_ffn:0" => format!("{l}.ffn.hc_pre"),
        "hc_ffn:post" | "hc_ffn:1" => format!("{l}.ffn.hc_pre.post"),
        "hc_ffn:comb" | "hc_ffn:2" => format!("{l}.ffn.hc_pre.comb"),
        "ffn_norm" => format!("{l}.ffn.norm"),
        "ffn.gate" | "ffn.gate:0" => format!("{l}.ffn.router"),
        "ffn.gate:idx" | "ffn.gate:1" => format!("{l}.ffn.router.idx"),
        "ffn.experts" => format!("{l}.ffn.experts"),
        "ffn.shared_experts" => format!("{l}.ffn.shared"),
        "ffn" => format!("{l}.ffn.out"),
        _ => return None,
    };
    m(op)
}

/// Which built-in naming (or a user map file) `--names` selected.
#[derive(Clone, Debug)]
pub enum NameMap {
    Official,
    Hf,
    Vllm,
    Sglang,
    File(UserMap),
}

/// A user map file (TOML):
///
/// ```toml
/// [map]
/// "engine.layer0.qkv" = { op = "L0.attn.q_a", split = { dim = -1, start = 0, len = 1536 } }
/// "engine.layer0.q_up" = { op = "L0.attn.q_b", concat_dim = -1 }
/// "engine.layer0.norm" = "L0.attn.norm"
/// ```
/// A name may also map to a list of such entries (a fused output feeding several ops). `reduce = "sum"`
/// marks per-rank partial sums; `head_dim` drops padded heads; `token_rows = false` keeps a tensor whole.
#[derive(Clone, Debug, Default)]
pub struct UserMap {
    pub entries: std::collections::BTreeMap<String, Vec<Rule>>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UserMapFile {
    map: std::collections::BTreeMap<String, UserValue>,
}

#[derive(serde::Deserialize)]
#[serde(untagged)]
enum UserValue {
    Op(String),
    One(UserEntry),
    Many(Vec<UserEntry>),
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct UserEntry {
    op: String,
    #[serde(default)]
    split: Option<Split>,
    #[serde(default)]
    concat_dim: Option<i64>,
    #[serde(default)]
    reduce: Option<String>,
    #[serde(default)]
    head_dim: Option<usize>,
    #[serde(default)]
    token_rows: Option<bool>,
}

impl UserMap {
    pub fn parse(text: &str, file: &std::path::Path) -> crate::Result<UserMap> {
        let f: UserMapFile = toml::from_str(text)
            .map_err(|e| crate::Error::bad(file, None, format!("name map: {e}")))?;
        let mut entries = std::collections::BTreeMap::new();
        for (name, v) in f.map {
            let list = match v {
                UserValue::Op(op) => vec![UserEntry {
                    op,
                    split: None,
                    concat_dim: None,
                    reduce: None,
                    head_dim: None,
                    token_rows: None,
                }],
                UserValue::One(e) => vec![e],
                UserValue::Many(v) => v,
            };
            let mut rules = Vec::new();
            for e in list {
                let shard = match (e.concat_dim, e.reduce.as_deref()) {
                    (Some(_), Some(_)) => {
                        return Err(crate::Error::bad(
                            file,
                            Some(&name),
                            "name map: give concat_dim or reduce, not both",
                        ))
                    }
                    (Some(d), None) => Shard::Concat(d),
                    (None, Some("sum")) => Shard::Sum,
                    (None, Some(r)) => {
                        return Err(crate::Error::bad(
                            file,
                            Some(&name),
                            format!("name map: reduce = \"{r}\" (only \"sum\" is known)"),
                        ))
                    }
                    (None, None) => Shard::Replicated,
                };
                if e.split.as_ref().is_some_and(|s| s.len == 0) {
                    return Err(crate::Error::bad(
                        file,
                        Some(&name),
                        "name map: split.len is 0",
                    ));
                }
                rules.push(Rule {
                    token_rows: e.token_rows.unwrap_or(!non_token_op(&e.op)),
                    op: e.op,
                    split: e.split,
                    shard,
                    head_dim: e.head_dim,
                    per_head: None,
                    scale: None,
                });
            }
            entries.insert(name, rules);
        }
        Ok(UserMap { entries })
    }
}

impl NameMap {
    /// `vllm | sglang | hf | official`, else a TOML map file.
    pub fn from_arg(arg: &str) -> crate::Result<NameMap> {
        Ok(match arg {
            "official" => NameMap::Official,
            "hf" => NameMap::Hf,
            "vllm" => NameMap::Vllm,
            "sglang" => NameMap::Sglang,
            path => {
                let p = std::path::Path::new(path);
                if !p.is_file() {
                    return Err(crate::Error::usage(format!(
                        "--names {path}: not one of vllm, sglang, hf, official, and no such map file"
                    )));
                }
                let text = crate::input::read_text(p, "name map", crate::input::SMALL_FILE_MAX)?;
                NameMap::File(UserMap::parse(&text, p)?)
            }
        })
    }

    pub fn label(&self) -> &'static str {
        match self {
            NameMap::Official => "official",
            NameMap::Hf => "hf",
            NameMap::Vllm => "vllm",
            NameMap::Sglang => "sglang",
            NameMap::File(_) => "map file",
        }
    }

    /// The ops a trace tensor feeds (empty: unmapped). Built-in maps also accept op ids verbatim, so a
    /// `run --dump` file compares as a trace. `has` says whether the trace holds another name: the
    /// families' engine maps read a module's output by what else its module wrote (a tuple's
    /// second element, a shared-expert module of its own; `super::engine_names`).
    pub fn rules(
        &self,
        name: &str,
        cfg: &crate::model::ModelConfig,
        has: &dyn Fn(&str) -> bool,
    ) -> Vec<Rule> {
        use super::engine_names::{self, Engine};
        let from = |m: Option<Mapped>| m.map(|m| vec![Rule::plain(m.op, m.token_rows)]);
        let found = match self {
            NameMap::Official => from(map_official(name)).map(|r| tp_defaults(r, cfg)),
            NameMap::Hf if cfg.family.is_some() => {
                from(super::family_names::map_hf(name, cfg)).map(|r| tp_defaults(r, cfg))
            }
            NameMap::Hf => from(map_hf(name)).map(|r| tp_defaults(r, cfg)),
            NameMap::Vllm if cfg.family.is_some() => {
                engine_names::map(Engine::Vllm, name, cfg, has)
            }
            NameMap::Sglang if cfg.family.is_some() => {
                engine_names::map(Engine::Sglang, name, cfg, has)
            }
            NameMap::Vllm => map_vllm(name, cfg),
            NameMap::Sglang => map_sglang(name, cfg),
            NameMap::File(u) => return u.entries.get(name).cloned().unwrap_or_default(),
        };
        found.unwrap_or_else(|| {
            if looks_like_op_id(name) {
                vec![Rule::plain(name.to_string(), !non_token_op(name))]
            } else {
                Vec::new()
            }
        })
    }
}

fn looks_like_op_id(name: &str) -> bool {
    matches!(
        name,
        "embed" | "hc_expand" | "hc_head" | "final_norm" | "head"
    ) || name
        .strip_prefix('L')
        .and_then(|r| r.split_once('.'))
        .is_some_and(|(n, rest)| n.parse::<usize>().is_ok() && !rest.is_empty())
}

/// Tensor-parallel layout of an op's output in the engines this tool knows (the same for every naming
/// that comes from a TP engine): q_b and the attention core are column-parallel over heads (maybe padded),
/// wo_a is column-parallel over groups, MoE outputs are partial sums until the all-reduce.
fn tp_defaults(rules: Vec<Rule>, cfg: &crate::model::ModelConfig) -> Vec<Rule> {
    rules
        .into_iter()
        .map(|r| {
            let o = r.op.clone();
            if o.ends_with(".attn.q_b") || o.ends_with(".attn.core") {
                r.concat(-1).heads(cfg.head_dim)
            } else if o.ends_with(".attn.wo_a") {
                r.concat(-1)
            } else if o.ends_with(".ffn.experts") || o.ends_with(".ffn.shared") {
                r.sum()
            } else {
                r
            }
        })
        .collect()
}

/// One op with the tensor-parallel defaults of its kind.
fn single(op: String, cfg: &crate::model::ModelConfig) -> Option<Vec<Rule>> {
    Some(tp_defaults(
        vec![Rule::plain(op.clone(), !non_token_op(&op))],
        cfg,
    ))
}

/// The engines' fused q_a/kv projection output, split by the config's sizes.
fn fused_qa_kv(l: &str, cfg: &crate::model::ModelConfig) -> Vec<Rule> {
    let q = cfg.q_lora_rank;
    vec![
        Rule::plain(format!("{l}.attn.q_a"), true).split(0, q),
        Rule::plain(format!("{l}.attn.kv"), true).split(q, cfg.head_dim),
    ]
}

/// vLLM's DeepSeek-V4 module paths (docs/DSV4-LAYER.md §2.4). The decoder layer returns (y₂, X₁, post_f, C_f):
/// `model.layers.N` is y₂ (the MoE output) and `:residual`, `:post`, `:comb` (or `:1`, `:2`, `:3`) the
/// rest; compare recombines them into the layer output (§3.2).
pub fn map_vllm(name: &str, cfg: &crate::model::ModelConfig) -> Option<Vec<Rule>> {
    let one = |op: String| single(op, cfg);
    match name {
        "model.embed_tokens" => return one("embed".into()),
        "model.hc_head" => return one("hc_head".into()),
        "model.norm" => return one("final_norm".into()),
        "lm_head" | "logits" => return one("head".into()),
        _ => {}
    }
    let (n, rest) = layer_and_rest(name, "model.layers.")?;
    let l = format!("L{n}");
    let op = match rest {
        "attn.fused_wqa_wkv" => return Some(fused_qa_kv(&l, cfg)),
        "" | ":0" => format!("{l}.ffn.out"),
        ":residual" | ":1" => format!("{l}.attn.hc_post"),
        ":post" | ":2" => format!("{l}.ffn.hc_pre.post"),
        ":comb" | ":3" => format!("{l}.ffn.hc_pre.comb"),
        "attn_norm" => format!("{l}.attn.norm"),
        "attn.wq_a" => format!("{l}.attn.q_a"),
        "attn.wkv" => format!("{l}.attn.kv"),
        "attn.q_norm" => format!("{l}.attn.q_norm"),
        "attn.kv_norm" => format!("{l}.attn.kv_norm"),
        "attn.wq_b" => format!("{l}.attn.q_b"),
        "attn.mla_attn.compressor" => format!("{l}.attn.compressor"),
        "attn.indexer" => format!("{l}.attn.indexer"),
        "attn.wo_a:input" => format!("{l}.attn.core"),
        "attn.wo_a" => format!("{l}.attn.wo_a"),
        "attn.wo_b" | "attn" => format!("{l}.attn.wo_b"),
        "ffn.norm_gate" | "ffn.norm_gate:0" | "ffn.norm_gate.norm" => format!("{l}.ffn.norm"),
        "ffn.experts" => format!("{l}.ffn.experts"),
        "ffn.shared_experts" => format!("{l}.ffn.shared"),
        "ffn" => format!("{l}.ffn.out"),
        _ => return None,
    };
    one(op)
}

/// SGLang's DeepSeek-V4 module paths (`python/sglang/srt/models/deepseek_v4.py`: `self_attn.wqkv_a` or
/// `wq_a`/`wkv`, `wq_b`, `wo_a`, `wo_b`, `compressor`, `indexer`; `mlp.{experts,shared_experts}`; the layer
/// returns the full residual streams after both mHC posts). Names follow SGLang's hook-mode dumper
/// (module paths) and probes/capture/sglang_capture.py.
pub fn map_sglang(name: &str, cfg: &crate::model::ModelConfig) -> Option<Vec<Rule>> {
    let one = |op: String| single(op, cfg);
    match name {
        "model.embed_tokens" => return one("embed".into()),
        "model.norm" => return one("final_norm".into()),
        "lm_head" | "logits" => return one("head".into()),
        _ => {}
    }
    let (n, rest) = layer_and_rest(name, "model.layers.")?;
    let l = format!("L{n}");
    let op = match rest {
        "self_attn.wqkv_a" => return Some(fused_qa_kv(&l, cfg)),
        "" => format!("{l}.out"),
        "input_layernorm" => format!("{l}.attn.norm"),
        "self_attn.wq_a" => format!("{l}.attn.q_a"),
        "self_attn.wkv" => format!("{l}.attn.kv"),
        "self_attn.q_norm" => format!("{l}.attn.q_norm"),
        "self_attn.kv_norm" => format!("{l}.attn.kv_norm"),
        "self_attn.wq_b" => format!("{l}.attn.q_b"),
        "self_attn.compressor" => format!("{l}.attn.compressor"),
        "self_attn.indexer" => format!("{l}.attn.indexer"),
        "self_attn.wo_a:input" => format!("{l}.attn.core"),
        "self_attn.wo_a" => format!("{l}.attn.wo_a"),
        "self_attn.wo_b" | "self_attn" => format!("{l}.attn.wo_b"),
        "post_attention_layernorm" => format!("{l}.ffn.norm"),
        "mlp.topk" | "mlp.topk:0" => format!("{l}.ffn.router"),
        "mlp.topk:idx" | "mlp.topk:1" => format!("{l}.ffn.router.idx"),
        "mlp.experts" => format!("{l}.ffn.experts"),
        "mlp.shared_experts" => format!("{l}.ffn.shared"),
        "mlp" => format!("{l}.ffn.out"),
        _ => return None,
    };
    one(op)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn hf_names() {
        assert_eq!(
            map_hf("model.layers.3.self_attn.q_b_proj").unwrap().op,
            "L3.attn.q_b"
        );
        assert_eq!(map_hf("model.layers.0").unwrap().op, "L0.out");
        assert_eq!(
            map_hf("model.layers.2.ffn_hc:input").unwrap().op,
            "L2.attn.hc_post"
        );
        assert!(
            !map_hf("model.layers.2.self_attn.compressor")
                .unwrap()
                .token_rows
        );
        assert!(map_hf("model.layers.2.self_attn.rotary_emb").is_none());
        assert_eq!(map_hf("lm_head").unwrap().op, "head");
    }
}
