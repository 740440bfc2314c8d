//! The faults that change a parameter rather than a linear weight, planted into the parameter
//! tensors after calibration (the producer calibrated the intact model): DeepSeek-V3's router
//! `e_score_correction_bias` left out of the export, Qwen3's per-head `q_norm`/`k_norm` stored
//! under each other's names.

use super::super::encode::RawT;
use super::super::plan::ParamSpec;
use crate::served::faults::{Fault, FaultKind};
use crate::{Error, Result};

/// Whether `kind` changes a parameter (planted by [`plant_params`]) rather than a linear weight.
pub fn is_param_fault(kind: FaultKind) -> bool {
    matches!(
        kind,
        FaultKind::MissingCorrectionBias | FaultKind::SwappedQkNorm
    )
}

/// The parameters a parameter fault changes: (canonical name, the op id that reads it).
fn param_targets(kind: FaultKind, params: &[&ParamSpec]) -> Vec<(String, String)> {
    let layer_op = |name: &str, tail: &str, op: &str| {
        let n = name.strip_prefix("layers.")?.strip_suffix(tail)?;
        Some((name.to_string(), format!("L{n}.{op}")))
    };
    params
        .iter()
        .filter_map(|p| match kind {
            FaultKind::MissingCorrectionBias => layer_op(&p.name, ".ffn.gate.bias", "ffn.router"),
            FaultKind::SwappedQkNorm => layer_op(&p.name, ".attn.q_norm.weight", "attn.q_norm")
                .or_else(|| layer_op(&p.name, ".attn.k_norm.weight", "attn.k_norm")),
            _ => None,
        })
        .collect()
}

fn hits(f: &Fault, name: &str, op: &str) -> bool {
    f.hits(name) || f.hits(name.strip_suffix(".weight").unwrap_or(name)) || f.target == op
}

/// Refuse a parameter fault that hits no parameter of its kind (naming the family that has them).
pub fn check_param_fault(f: &Fault, params: &[&ParamSpec], what: &str) -> Result<()> {
    let t = param_targets(f.kind, params);
    if t.iter().any(|(name, op)| hits(f, name, op)) {
        return Ok(());
    }
    let has = match f.kind {
        FaultKind::MissingCorrectionBias => {
            "the DeepSeek-V3 router's `e_score_correction_bias` (synth --family deepseek-v3; targets like L1.ffn.router)"
        }
        _ => "Qwen3's per-head `q_norm`/`k_norm` (synth --family qwen3-moe; targets like L1.attn.q_norm)",
    };
    Err(Error::usage(format!(
        "fault {}@{}: the target matches no parameter it changes in this {what} checkpoint: it needs {has}",
        f.kind.name(),
        f.target
    )))
}

/// Plant the parameter faults into the parameter tensors (aligned with `params`): a dropped
/// correction bias becomes `None` (not written), swapped q/k norms trade their bytes.
pub fn plant_params(faults: &[Fault], params: &[&ParamSpec], ts: &mut [Option<RawT>]) {
    for f in faults.iter().filter(|f| is_param_fault(f.kind)) {
        let t = param_targets(f.kind, params);
        let hit: Vec<&String> = t
            .iter()
            .filter(|(name, op)| hits(f, name, op))
            .map(|(n, _)| n)
            .collect();
        let idx = |name: &str| params.iter().position(|p| p.name == name);
        match f.kind {
            FaultKind::MissingCorrectionBias => {
                for i in hit.iter().filter_map(|n| idx(n)) {
                    ts[i] = None;
                }
            }
            FaultKind::SwappedQkNorm => {
                let mut layers: Vec<&str> = hit
                    .iter()
                    .filter_map(|n| n.split_once(".attn.").map(|x| x.0))
                    .collect();
                layers.sort_unstable();
                layers.dedup();
                for l in layers {
                    let (Some(q), Some(k)) = (
                        idx(&format!("{l}.attn.q_norm.weight")),
                        idx(&format!("{l}.attn.k_norm.weight")),
                    ) else {
                        continue;
                    };
                    let qb = ts[q].as_ref().map(|t| t.bytes.clone());
                    let kb = ts[k].as_ref().map(|t| t.bytes.clone());
                    if let (Some(tq), Some(kb)) = (ts[q].as_mut(), kb) {
                        tq.bytes = kb;
                    }
                    if let (Some(tk), Some(qb)) = (ts[k].as_mut(), qb) {
                        tk.bytes = qb;
                    }
                }
            }
            _ => {}
        }
    }
}
