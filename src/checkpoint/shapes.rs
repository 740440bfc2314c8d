//! Every shape config.json fixes, checked against the tensors' headers before anything runs:
//! the linears' logical shapes ([`Checkpoint::check_config_shape`], `quant::expected_shape`) and
//! the parameters' element counts (norm weights, biases, mHC, the compressors' `ape`, sinks),
//! per op of the graph as the op math reads them. `run` refuses the first contradiction for the
//! layers it runs (exit 2, naming the tensor's file, config.json and the fields), and lint reports
//! every one of the layers the checkpoint holds (`config.model`): one checker, so that lint never
//! says 0 errors where `run` refuses — and `run` refuses before the op that would read the
//! tensor (a compressor's `ape` is read only once a whole block of tokens reaches it).

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::Checkpoint;
use crate::model::graph::{build_graph, layer_graph, Op, OpKind};
use crate::model::ModelConfig;
use crate::{Error, Result};

/// A tensor whose header contradicts the config.
#[derive(Clone, Debug, PartialEq)]
pub struct ShapeProblem {
    /// The shard holding the tensor.
    pub file: PathBuf,
    /// The tensor as the checkpoint names it.
    pub tensor: String,
    /// Its canonical weight or parameter name.
    pub base: String,
    /// What contradicts what, naming config.json and the fields.
    pub msg: String,
}

impl ShapeProblem {
    pub fn to_error(&self) -> Error {
        Error::bad(&self.file, Some(&self.tensor), self.msg.clone())
    }
}

/// The element count a parameter of `op` must have, and the config fields that fix it; None for
/// the op's linear weights and what the config does not fix.
fn expected_param(cfg: &ModelConfig, op: &Op, i: usize, name: &str) -> Option<(usize, String)> {
    let d = cfg.hidden_size;
    let fam = cfg.family.as_ref();
    let hc = cfg.hc_mult;
    let f = |n: usize, s: &str| Some((n, s.to_string()));
    match op.kind {
        OpKind::RmsNorm => {
            if name.ends_with("attn.q_norm.weight") || name.ends_with("attn.q_a_layernorm.weight") {
                f(cfg.q_lora_rank, "q_lora_rank")
            } else if name.ends_with("attn.kv_norm.weight") {
                f(cfg.head_dim, "head_dim")
            } else {
                f(d, "hidden_size")
            }
        }
        OpKind::HeadNorm => f(cfg.head_dim, "head_dim"),
        OpKind::LatentNorm => f(fam?.kv_lora_rank, "kv_lora_rank"),
        OpKind::HcPre => match i {
            0 => f(
                cfg.hc_mix() * hc * d,
                "(2+hc_mult)·hc_mult · hc_mult·hidden_size",
            ),
            1 => f(cfg.hc_mix(), "(2+hc_mult)·hc_mult"),
            2 => f(3, "3 (pre, post, comb)"),
            _ => None,
        },
        OpKind::HcHead => match i {
            0 => f(hc * hc * d, "hc_mult · hc_mult·hidden_size"),
            1 => f(hc, "hc_mult"),
            2 => f(1, "a scalar"),
            _ => None,
        },
        OpKind::Compressor | OpKind::Indexer => {
            let (at, dc, field) = if op.kind == OpKind::Compressor {
                (2, cfg.head_dim, "head_dim")
            } else {
                (4, cfg.index_head_dim, "index_head_dim")
            };
            let ratio = cfg.ratio(op.layer?);
            let c = if ratio == 4 { 2 } else { 1 };
            if i == at {
                Some((
                    ratio * c * dc,
                    format!("compress_ratios[{}] = {ratio} × {c}·{field}", op.layer?),
                ))
            } else if i == at + 1 {
                f(dc, field)
            } else {
                None
            }
        }
        OpKind::Attention | OpKind::GqaAttention if name.ends_with("attn_sink") => {
            f(cfg.num_attention_heads, "num_attention_heads")
        }
        OpKind::Router if name.ends_with(".bias") => f(cfg.n_routed_experts, "n_routed_experts"),
        OpKind::Linear if i == 1 => {
            let base = op.weights.first()?;
            let ((o, _), fields) = super::quant::expected_shape(cfg, base)?;
            Some((o, format!("the output rows of `{base}`: {fields}")))
        }
        OpKind::GptOssExperts if name.ends_with(".bias") => {
            let base = name.strip_suffix(".bias")?;
            let ((o, _), fields) = super::quant::expected_shape(cfg, base)?;
            Some((o, format!("the output rows of `{base}`: {fields}")))
        }
        _ => None,
    }
}

/// The linear weight bases `op` reads.
fn linear_bases(op: &Op) -> Vec<&str> {
    let w = |r: std::ops::Range<usize>| -> Vec<&str> {
        op.weights
            .get(r.start.min(op.weights.len())..r.end.min(op.weights.len()))
            .unwrap_or_default()
            .iter()
            .map(String::as_str)
            .collect()
    };
    match op.kind {
        OpKind::Linear | OpKind::GroupedLinear | OpKind::Router => w(0..1),
        OpKind::Compressor => w(0..2),
        OpKind::Indexer => w(0..4),
        OpKind::Experts | OpKind::SharedExpert | OpKind::Mlp => w(0..op.weights.len()),
        OpKind::GptOssExperts => op
            .weights
            .iter()
            .filter(|n| !n.ends_with(".bias"))
            .map(String::as_str)
            .collect(),
        _ => Vec::new(),
    }
}

/// The problems of `ops`' tensors; `linears`: also the linears' shapes (lint checks those per
/// weight, as `weight_meta` does).
fn problems_of(ck: &Checkpoint, cfg: &ModelConfig, ops: &[Op], linears: bool) -> Vec<ShapeProblem> {
    let mut out = Vec::new();
    for op in ops {
        for (i, name) in op.weights.iter().enumerate() {
            let Some((n, fields)) = expected_param(cfg, op, i, name) else {
                continue;
            };
            let Some(info) = ck.canonical_info(name) else {
                continue; // missing: `weight.missing`, or the op's refusal
            };
            let have: usize = info.shape.iter().product();
            if have != n {
                out.push(ShapeProblem {
                    file: info.file.clone(),
                    tensor: ck.raw_label(name).unwrap_or_else(|| name.clone()),
                    base: name.clone(),
                    msg: format!(
                        "has {have} elements (shape {:?}), config.json implies {n} ({fields}) for {}",
                        info.shape, op.id
                    ),
                });
            }
        }
        if op.kind == OpKind::Embed {
            if let Some(info) = ck.canonical_info("embed.weight") {
                if info.shape.len() != 2 || info.shape[1] != cfg.hidden_size {
                    out.push(ShapeProblem {
                        file: info.file.clone(),
                        tensor: ck
                            .raw_label("embed.weight")
                            .unwrap_or_else(|| "embed.weight".into()),
                        base: "embed".into(),
                        msg: format!(
                            "has shape {:?}, config.json implies [vocab, {}] (hidden_size)",
                            info.shape, cfg.hidden_size
                        ),
                    });
                }
            }
        }
        if linears {
            for base in linear_bases(op) {
                // an unreadable weight is the op's (or lint's `tensor.invalid`) to report
                if let Ok(m) = ck.weight_meta_unchecked(base) {
                    if let Err(Error::BadInput { file, tensor, msg }) = ck.check_config_shape(&m) {
                        out.push(ShapeProblem {
                            file,
                            tensor: tensor.unwrap_or_else(|| base.to_string()),
                            base: base.to_string(),
                            msg,
                        });
                    }
                }
            }
        }
    }
    out
}

/// The ops outside any layer: the embedding (and the mHC expansion), and with `with_head` the
/// head's (V4's `hc_head`, the final norm, the head).
fn model_level(cfg: &ModelConfig, with_head: bool) -> Vec<Op> {
    build_graph(cfg, 0, with_head)
        .into_iter()
        .filter(|o| o.layer.is_none())
        .collect()
}

/// `run`'s check: the first tensor of layers `0..=last` (and the head when `with_head`) whose
/// shape contradicts config.json, as a refusal (exit 2) naming its file, config.json and fields.
pub fn check_shapes(
    ck: &Checkpoint,
    cfg: &ModelConfig,
    last: usize,
    with_head: bool,
) -> Result<()> {
    if let Some(p) = problems_of(ck, cfg, &model_level(cfg, with_head), true).first() {
        return Err(p.to_error());
    }
    // one layer at a time, as the runner builds them
    for n in 0..=last.min(cfg.num_hidden_layers.saturating_sub(1)) {
        if let Some(p) = problems_of(ck, cfg, &layer_graph(cfg, n), true).first() {
            return Err(p.to_error());
        }
    }
    Ok(())
}

/// Lint's check: the parameters of every layer the checkpoint holds, and of the embedding and
/// the head, whose shapes contradict config.json (the linears' shapes lint checks per weight).
/// Empty when the config is unusable (reported on its own).
pub fn shape_problems(ck: &Checkpoint) -> Vec<ShapeProblem> {
    let Ok(cfg) = ck.model_config() else {
        return Vec::new();
    };
    let names = ck.canonical_names();
    let layers: BTreeSet<usize> = names
        .iter()
        .filter_map(|n| n.strip_prefix("layers.")?.split('.').next()?.parse().ok())
        .filter(|&l| l < cfg.num_hidden_layers)
        .collect();
    let mut out = problems_of(ck, cfg, &model_level(cfg, true), false);
    for n in layers {
        out.extend(problems_of(ck, cfg, &layer_graph(cfg, n), false));
    }
    out
}
