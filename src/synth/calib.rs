//! Static activation scales the way producers make them: run the FP32 model on sample tokens,
//! record max|x| at the input of every linear (per weight, every expert separately), derive the
//! scale from that amax.

use std::collections::HashMap;

use crate::model::exec::OpEnv;
use crate::model::{build_graph, run_graph, MemEnv, ModelConfig};
use crate::{Result, Tensor};

use super::gen::Stream;

/// Wraps the in-memory f32 env and records the input amax of each linear by weight base.
struct CalibEnv {
    inner: MemEnv,
    amax: HashMap<String, f32>,
}

impl CalibEnv {
    fn note(&mut self, base: &str, x: &Tensor) {
        let a = crate::numerics::nvfp4::amax(&x.data);
        let e = self.amax.entry(base.to_string()).or_insert(0.0);
        *e = e.max(a);
    }
}

impl OpEnv for CalibEnv {
    fn cfg(&self) -> &ModelConfig {
        self.inner.cfg()
    }
    fn token_ids(&self) -> &[u32] {
        self.inner.token_ids()
    }
    fn param(&mut self, canonical: &str) -> Result<Tensor> {
        self.inner.param(canonical)
    }
    fn embed_rows(&mut self, ids: &[u32]) -> Result<Tensor> {
        self.inner.embed_rows(ids)
    }
    fn linear(&mut self, sub_id: &str, x: &Tensor, base: &str) -> Result<Tensor> {
        self.note(base, x);
        self.inner.linear(sub_id, x, base)
    }
    fn linear_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor> {
        self.note(base, x);
        self.inner.linear_grouped(sub_id, x, base, groups)
    }
    fn store(&self, t: &mut Tensor) {
        self.inner.store(t)
    }
}

/// Deterministic calibration tokens (uniform over the vocabulary).
pub fn sample_tokens(seed: u64, vocab: usize, t: usize) -> Vec<u32> {
    let mut s = Stream::new(seed, "calibration-tokens");
    (0..t).map(|_| s.below(vocab) as u32).collect()
}

/// Run the FP32 forward of every layer (no head) over `tokens`; returns the observed input
/// amax per linear base and gives the weights back.
pub fn calibrate(
    cfg: &ModelConfig,
    params: HashMap<String, Tensor>,
    linears: HashMap<String, Tensor>,
    tokens: Vec<u32>,
) -> Result<(HashMap<String, f32>, HashMap<String, Tensor>)> {
    let mut env = CalibEnv {
        inner: MemEnv {
            cfg: cfg.clone(),
            tokens,
            params,
            linears,
            bf16: false,
            calls: Vec::new(),
        },
        amax: HashMap::new(),
    };
    let last = cfg.num_hidden_layers.saturating_sub(1);
    let graph = build_graph(cfg, last, false);
    run_graph(&graph, &mut env)?;
    Ok((env.amax, env.inner.linears))
}

/// Input amax for `base` with the producers' fallbacks: an expert no calibration token was
/// routed to takes the layer's max over experts of the same projection; any other weight
/// never reached takes the max seen in its layer.
pub fn amax_for(seen: &HashMap<String, f32>, base: &str) -> f32 {
    if let Some(&a) = seen.get(base) {
        return a;
    }
    let layer_prefix = match base.strip_prefix("layers.") {
        Some(r) => format!("layers.{}.", r.split('.').next().unwrap_or("")),
        None => String::new(),
    };
    let proj = base.rsplit('.').next().unwrap_or("");
    let expert_of_layer = format!("{layer_prefix}ffn.experts.");
    let pick = |f: &dyn Fn(&str) -> bool| {
        seen.iter()
            .filter(|(k, _)| f(k))
            .map(|(_, &v)| v)
            .fold(f32::NAN, |m, v| if m.is_nan() { v } else { m.max(v) })
    };
    if base.starts_with(&expert_of_layer) {
        let a =
            pick(&|k: &str| k.starts_with(&expert_of_layer) && k.ends_with(&format!(".{proj}")));
        if !a.is_nan() {
            return a;
        }
    }
    let a = pick(&|k: &str| k.starts_with(&layer_prefix));
    if a.is_nan() {
        1.0
    } else {
        a
    }
}
