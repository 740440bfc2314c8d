//! Which weights and parameters the layers a checkpoint holds are missing.
//!
//! Why: `inspect` and `lint` describe the weights that are there; a whole expert left out of an
//! export (its `.weight` and every scale) leaves nothing to describe, so 181 of 182 weights passed
//! unmentioned and the run failed later. The config says what each layer reads (the op graph of
//! that layer: `model::graph::layer_graph`); every layer of which the checkpoint holds any tensor
//! is checked against it — layers it does not hold at all are a partial checkpoint, not a
//! missing weight — so the work is bounded by the tensors present, whatever the config claims.

use std::collections::BTreeSet;
use std::path::PathBuf;

use super::Checkpoint;
use crate::model::graph::{layer_graph, OpKind};

/// A tensor the config requires of a layer the checkpoint holds, but that no stored tensor maps to.
#[derive(Clone, Debug, PartialEq)]
pub struct MissingTensor {
    /// The canonical (official) name expected, e.g. `layers.1.ffn.experts.3.w1.weight`.
    pub tensor: String,
    /// The weight or parameter it belongs to (`layers.1.ffn.experts.3.w1`).
    pub base: String,
    /// A file holding the layer's other tensors (where it belongs), else the checkpoint's location.
    pub file: PathBuf,
    /// What it is, for messages ("linear weight of L1.ffn.experts").
    pub what: String,
}

/// Leaf names of parameters read as whole tensors (everything else an op reads is a linear
/// weight base whose tensor is `base.weight` or `base.weight_packed`).
fn is_param(name: &str) -> bool {
    let leaf = name.rsplit('.').next().unwrap_or(name);
    matches!(leaf, "weight" | "bias" | "tid2eid" | "attn_sink" | "ape") || leaf.starts_with("hc_")
}

impl Checkpoint {
    /// Tensors the config requires of the layers present (and of the embedding and the head
    /// when present) that the checkpoint lacks; empty when the config itself is unusable (that
    /// is reported on its own).
    pub fn missing_tensors(&self) -> Vec<MissingTensor> {
        let Ok(cfg) = self.model_config() else {
            return Vec::new();
        };
        let names = self.canonical_names();
        let layers: BTreeSet<usize> = names
            .iter()
            .filter_map(|n| n.strip_prefix("layers.")?.split('.').next()?.parse().ok())
            .filter(|&l| l < cfg.num_hidden_layers)
            .collect();
        let has = |n: &str| self.canonical_info(n).is_some();
        let present = |w: &str| {
            if is_param(w) {
                has(w)
            } else {
                has(&format!("{w}.weight")) || has(&format!("{w}.weight_packed"))
            }
        };
        let file_near = |prefix: &str| {
            names
                .iter()
                .find(|n| n.starts_with(prefix))
                .and_then(|n| self.canonical_info(n))
                .map(|i| i.file)
                .unwrap_or_else(|| self.location.clone())
        };
        let mut out = Vec::new();
        let mut need = |w: &str, op: &str, kind: &str, file: PathBuf| {
            if !present(w) {
                let tensor = if is_param(w) {
                    w.to_string()
                } else {
                    format!("{w}.weight")
                };
                out.push(MissingTensor {
                    tensor,
                    base: w.to_string(),
                    file,
                    what: format!("{kind} of {op}"),
                });
            }
        };
        for &l in &layers {
            let file = file_near(&format!("layers.{l}."));
            for op in layer_graph(cfg, l) {
                for (i, w) in op.weights.iter().enumerate() {
                    let kind = match op.kind {
                        OpKind::Linear
                        | OpKind::GroupedLinear
                        | OpKind::SharedExpert
                        | OpKind::Experts => "linear weight",
                        OpKind::Router if i == 0 => "linear weight",
                        _ if !is_param(w) => "linear weight",
                        _ => "parameter",
                    };
                    need(w, &op.id, kind, file.clone());
                }
            }
        }
        if layers.contains(&0) {
            need("embed.weight", "embed", "parameter", file_near("layers.0."));
        }
        if has("head.weight") {
            let f = file_near("head.");
            // the families other than V4 have no mHC head collapse
            let params: &[&str] = if cfg.family.is_some() {
                &["norm.weight"]
            } else {
                &["hc_head_fn", "hc_head_base", "hc_head_scale", "norm.weight"]
            };
            for &w in params {
                need(w, "hc_head", "parameter", f.clone());
            }
        }
        out
    }
}
