//! Replay one op: capture what the BF16 oracle feeds it (running only the oracle path over the
//! prefix, keeping only the tensors the op consumes), then evaluate the op's served numerics on
//! those inputs under any number of hypotheses. Each hypothesis costs one op, not one run.
//!
//! The evaluation runs in the runner's environment (`probe::env::PathEnv` on the served path)
//! with a [`ReplayTrace`] set: a hypothesis chooses, per weight, how the served path reads it: in
//! the BF16 oracle's numerics (to localise the culprit weight of a fused op), under scalar or
//! layout [`Override`]s, or pinned to block scales re-read from the checkpoint bytes (repairs no
//! `Override` expresses). Its linears are the run's backend's `served::Linears` (the host
//! reference or the device's), held by the replayer's [`Shared`] and kept across hypotheses, so
//! one environment serves both backends and both callers:
//! - each hypothesis re-resolves only the served reading of the bases it patches (scalar
//!   overrides and the nibble order from the overrides; layout repairs and re-read stored block
//!   scales as rearranged scale bytes computed on the host from the scale tensor alone, then
//!   pinned with `Linears::pin_nvfp4`);
//! - on CUDA the op's stored bytes stay resident on the device across hypotheses, and nothing is
//!   dequantized on the host.
//!
//! Hypothesis formation ([`Replayer::params`], [`Replayer::meta`]) reads headers and scalar scales
//! only, on both backends.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::checkpoint::{Checkpoint, WeightMeta};
use crate::metrics::Compare;
use crate::model::exec::exec;
use crate::model::graph::{build_graph, Op};
use crate::numerics::{e4m3, nvfp4};
use crate::probe::env::{PathEnv, ReplayTrace, Shared};
use crate::probe::RunOptions;
use crate::served::{self, LinearObs, Nvfp4Params, Override, PathKind};
use crate::{Error, Result, Tensor};

pub use crate::served::linears::nvfp4_convention;

/// The BF16-oracle view of one op: its inputs and outputs.
#[derive(Clone, Debug)]
pub struct Capture {
    pub op: Op,
    pub inputs: Vec<Tensor>,
    pub oracle_bf16: Vec<Tensor>,
}

/// Run the BF16 oracle up to `op_id` and keep the op's inputs and outputs. Costs one path over the
/// prefix (a third of a run's work there), and memory for the live activations only.
pub fn capture(ckpt: &Checkpoint, opts: &RunOptions, op_id: &str) -> Result<Capture> {
    let cfg = ckpt.model_config()?.clone();
    let b = opts.layers.1.min(cfg.num_hidden_layers.saturating_sub(1));
    let with_head = b + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
    let ops = build_graph(&cfg, b, with_head);
    let idx = ops.iter().position(|o| o.id == op_id).ok_or_else(|| {
        Error::usage(format!("op `{op_id}` is not in the graph of layers 0..{b}"))
    })?;
    let mut last_use: HashMap<&str, usize> = HashMap::new();
    for (i, op) in ops[..=idx].iter().enumerate() {
        for inp in &op.inputs {
            last_use.insert(inp.as_str(), i);
        }
    }
    let mut shared = opts.shared(ckpt, cfg);
    let mut vals: HashMap<String, Tensor> = HashMap::new();
    for (step, op) in ops[..idx].iter().enumerate() {
        let ins: Vec<&Tensor> = op
            .inputs
            .iter()
            .map(|i| {
                vals.get(i).ok_or_else(|| {
                    Error::usage(format!("internal: input {i} of {} missing", op.id))
                })
            })
            .collect::<Result<_>>()?;
        let mut env = PathEnv {
            kind: PathKind::OracleBf16,
            shared: &mut shared,
        };
        let outs = exec(op, &ins, &mut env)?;
        shared.clear();
        for (id, t) in op.outputs.iter().zip(outs) {
            vals.insert(id.clone(), t);
        }
        vals.retain(|id, _| last_use.get(id.as_str()).is_some_and(|&l| l > step));
    }
    let op = ops[idx].clone();
    let inputs: Vec<Tensor> = op
        .inputs
        .iter()
        .map(|i| {
            vals.remove(i)
                .ok_or_else(|| Error::usage(format!("internal: input {i} of {op_id} missing")))
        })
        .collect::<Result<_>>()?;
    let refs: Vec<&Tensor> = inputs.iter().collect();
    let oracle_bf16 = {
        let mut env = PathEnv {
            kind: PathKind::OracleBf16,
            shared: &mut shared,
        };
        exec(&op, &refs, &mut env)?
    };
    Ok(Capture {
        op,
        inputs,
        oracle_bf16,
    })
}

/// A change to how the served path reads one weight.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub enum Patch {
    /// One of the runner's overrides (applied after the loader's reading, like `RunOptions::overrides`).
    Ov(Override),
    /// Block scales read from the checkpoint's `weight_scale` bytes in their linear layout, with
    /// non-finite bytes re-derived as the median of the row's finite scales.
    StoredBlockScales,
    /// The weight in the BF16 oracle's numerics (localisation only, never a verdict).
    Oracle,
}

/// One served evaluation of the captured op.
#[derive(Clone, Debug)]
pub struct Eval {
    pub outputs: Vec<Tensor>,
    pub vs_bf16: Compare,
    /// (sub id, weight base, observation) of every served linear.
    pub obs: Vec<(String, String, LinearObs)>,
    /// amax of the activation each weight base was fed (max over calls).
    pub act_amax: HashMap<String, f32>,
}

/// Re-evaluates one captured op's served numerics under patches, reusing the weights read.
pub struct Replayer<'a> {
    pub cap: Capture,
    /// The environment of the evaluations: the run's checkpoint, tokens, profile, loader faults
    /// and backend; its linears hold the op's weights across hypotheses, its overrides are the
    /// current hypothesis's.
    shared: Shared<'a>,
    /// Bases whose served reading the last evaluation pinned (stored block scales, layout repairs).
    pinned: Vec<String>,
    /// Per base, the stored block scales with non-finite bytes re-derived (None: all finite).
    stored_scales: HashMap<String, Option<Arc<Vec<u8>>>>,
}

impl Drop for Replayer<'_> {
    fn drop(&mut self) {
        // the op's weights stayed resident across the hypotheses
        self.shared.clear();
    }
}

impl<'a> Replayer<'a> {
    pub fn new(ckpt: &'a Checkpoint, opts: &RunOptions, cap: Capture) -> Result<Self> {
        let cfg = ckpt.model_config()?.clone();
        // the run's overrides are not the replay's: each evaluation sets its hypothesis's
        let mut shared = Shared::new(ckpt, cfg, opts.tokens.clone(), opts.profile);
        shared.faults = opts.loader_faults.clone();
        shared.prefill = opts.prefill.clone();
        shared.set_backend(opts.backend.clone());
        Ok(Replayer {
            cap,
            shared,
            pinned: Vec::new(),
            stored_scales: HashMap::new(),
        })
    }

    /// The checkpoint replayed.
    pub fn ckpt(&self) -> &'a Checkpoint {
        self.shared.ckpt
    }

    /// The served profile the replay evaluates under.
    pub fn profile(&self) -> crate::served::Profile {
        self.shared.profile
    }

    /// True when the replay evaluates on the CUDA device.
    pub fn on_device(&self) -> bool {
        self.shared.backend().on_device()
    }

    /// A base's metadata: tensor names, scheme, shape, stored scalar scales (headers and scalars
    /// only, nothing decoded).
    pub fn meta(&self, base: &str) -> Result<WeightMeta> {
        self.shared.ckpt.weight_meta(base)
    }

    /// The loader's NVFP4 parameters of a base (faults applied, fused pairs merged), if it is
    /// NVFP4: what the served reading of the weight uses, resolved from the stored scalars without
    /// decoding the weight.
    pub fn params(&mut self, base: &str) -> Result<Option<Nvfp4Params>> {
        let m = self.meta(base)?;
        let Some(conv) = nvfp4_convention(&m) else {
            return Ok(None);
        };
        let faults = crate::served::faults::hitting(&self.shared.faults, base);
        Ok(Some(served::resolve_nvfp4_named(
            self.shared.ckpt,
            &m.canonical,
            conv,
            m.weight_global.unwrap_or(f32::NAN),
            m.input_global,
            true,
            &faults,
        )))
    }
}

/// The stored block-scale bytes of a row-major [rows, nb] E4M3 scale tensor with every non-finite
/// byte replaced by the byte of its row's median finite scale (0x00 when the row has none): the
/// bytes whose decoding is the CPU decoding's multipliers (median of the row's finite values). None when every byte is finite
/// (the stored bytes serve as they are).
pub fn repaired_scale_bytes(scales: &[u8], rows: usize, nb: usize) -> Option<Vec<u8>> {
    let sc = &scales[..(rows * nb).min(scales.len())];
    let finite = |b: u8| e4m3::decode(b).is_finite();
    if sc.iter().all(|&b| finite(b)) {
        return None;
    }
    let mut out = sc.to_vec();
    for row in out.chunks_mut(nb.max(1)) {
        if row.iter().all(|&b| finite(b)) {
            continue;
        }
        let mut f: Vec<(f32, u8)> = row
            .iter()
            .map(|&b| (e4m3::decode(b), b))
            .filter(|(v, _)| v.is_finite())
            .collect();
        f.sort_by(|a, b| a.0.total_cmp(&b.0));
        let med = f.get(f.len() / 2).map_or(0x00, |x| x.1);
        for b in row.iter_mut() {
            if !finite(*b) {
                *b = med;
            }
        }
    }
    Some(out)
}

impl Replayer<'_> {
    fn quantized(&self, base: &str) -> bool {
        self.shared.is_quantized(base)
    }

    /// The repaired stored block scales of NVFP4 bases (cached per base; computed in parallel
    /// from the scale tensors alone).
    fn stored_scales_of(&mut self, bases: &[&str]) -> Result<()> {
        use rayon::prelude::*;
        let todo: Vec<&str> = bases
            .iter()
            .copied()
            .filter(|b| !self.stored_scales.contains_key(*b))
            .collect();
        let ckpt = self.shared.ckpt;
        let got: Vec<(String, Option<Arc<Vec<u8>>>)> = todo
            .par_iter()
            .map(|&b| {
                let lay = ckpt.weight_layout(b)?;
                let m = &lay.meta;
                if nvfp4_convention(m).is_none() {
                    return Err(Error::usage(
                        "internal: stored block scales of a non-NVFP4 weight",
                    ));
                }
                let (rows, nb) = (m.out_features, m.in_features / nvfp4::BLOCK);
                let name = lay.scale.as_deref().ok_or_else(|| {
                    Error::bad(
                        &m.file,
                        Some(b),
                        "NVFP4 weight without a block-scale tensor",
                    )
                })?;
                let bytes = ckpt.canonical_bytes(name)?;
                if bytes.len() < rows * nb {
                    return Err(Error::bad(
                        &m.file,
                        Some(b),
                        "NVFP4 bytes shorter than the weight's shape",
                    ));
                }
                Ok((
                    b.to_string(),
                    repaired_scale_bytes(&bytes, rows, nb).map(Arc::new),
                ))
            })
            .collect::<Result<_>>()?;
        self.stored_scales.extend(got);
        Ok(())
    }

    /// One evaluation on the device: the patches become the overrides of the device linears, the
    /// oracle-patched (and unquantized) weights run in the BF16 oracle's numerics, and bases with
    /// re-read stored block scales are pinned to those bytes for this evaluation.
    /// How the CUDA evaluator applies a patch set (see [`DevicePlan`]).
    fn device_plan(&self, patches: &[(String, Patch)]) -> DevicePlan {
        let overrides: Vec<(String, Override)> = patches
            .iter()
            .filter_map(|(b, p)| match p {
                Patch::Ov(o) => Some((b.clone(), o.clone())),
                _ => None,
            })
            .collect();
        let oracle: HashSet<String> = patches
            .iter()
            .filter(|(_, p)| *p == Patch::Oracle)
            .map(|(b, _)| b.clone())
            .collect();
        // as the CPU evaluator: an oracle patch or an unquantized weight wins over a repair
        let mut stored: Vec<String> = Vec::new();
        for (b, p) in patches {
            if *p == Patch::StoredBlockScales
                && !oracle.contains(b)
                && self.quantized(b)
                && !stored.contains(b)
            {
                stored.push(b.clone());
            }
        }
        // layout repairs: their rearranged scale bytes are prepared on the host in parallel
        let mut layout: Vec<String> = Vec::new();
        for (b, p) in patches {
            if matches!(p, Patch::Ov(Override::Unswizzle | Override::UnshiftRows))
                && !oracle.contains(b)
                && !stored.contains(b)
                && !layout.contains(b)
                && self.quantized(b)
                && self.meta(b).is_ok_and(|m| nvfp4_convention(&m).is_some())
            {
                layout.push(b.clone());
            }
        }
        DevicePlan {
            overrides,
            oracle,
            stored,
            layout,
        }
    }

    /// The rearranged block-scale bytes and nibble order of NVFP4 bases under their layout
    /// repairs and loader faults (`served::nvfp4_served_bytes`, as the device would resolve them
    /// one by one), in parallel from the scale tensors alone.
    fn layout_scales(
        &self,
        bases: &[String],
        overrides: &[(String, Override)],
    ) -> Result<Vec<(Vec<u8>, bool)>> {
        use rayon::prelude::*;
        let (ckpt, all_faults) = (self.shared.ckpt, &self.shared.faults);
        bases
            .par_iter()
            .map(|b| {
                let lay = ckpt.weight_layout(b)?;
                let m = &lay.meta;
                let conv = nvfp4_convention(m)
                    .ok_or_else(|| Error::usage("internal: layout repair of a non-NVFP4 weight"))?;
                let faults = crate::served::faults::hitting(all_faults, b);
                let ovs = served::overrides_of(overrides, b);
                let (sc, swap, _) =
                    served::nvfp4_served_bytes(ckpt, m, conv, true, &faults, &ovs, || {
                        let name = lay.scale.as_deref().ok_or_else(|| {
                            Error::bad(
                                &m.file,
                                Some(b),
                                "NVFP4 weight without a block-scale tensor",
                            )
                        })?;
                        Ok(ckpt.canonical_bytes(name)?.to_vec())
                    })?;
                let sc = sc.ok_or_else(|| Error::usage("internal: no layout change"))?;
                Ok((sc, swap))
            })
            .collect()
    }

    /// The nibble order of a base pinned to its stored block scales: the stored bytes as they
    /// are (no loader nibble-swap fault, as `stored_block_scale_wq`), swapped by a repair on top.
    fn stored_swap(overrides: &[(String, Override)], base: &str) -> bool {
        overrides
            .iter()
            .any(|(ob, o)| ob == base && *o == Override::NibbleSwap)
    }
    /// Whether the served path prefills this op in an engine's chunks (`--served-chunk`).
    pub fn prefills_in_chunks(&self) -> bool {
        self.shared
            .prefill
            .as_ref()
            .is_some_and(|p| crate::probe::prefill::splits(&self.cap.op, p))
    }

    /// [`Replayer::eval`] without patches, the prompt prefilled whole (no `--served-chunk`):
    /// what the op would compute without the engine's chunk boundaries.
    pub fn eval_prefilled_whole(&mut self) -> Result<Eval> {
        let p = self.shared.prefill.take();
        let r = self.eval(&[]);
        self.shared.prefill = p;
        r
    }

    /// Evaluate the op's served numerics with `patches` on (base, patch) pairs: the patches
    /// become the linears' overrides, the oracle-patched (and unquantized) weights run in the BF16
    /// oracle's numerics, and bases with re-read stored block scales or a layout repair are pinned
    /// to those bytes for this evaluation.
    pub fn eval(&mut self, patches: &[(String, Patch)]) -> Result<Eval> {
        let DevicePlan {
            overrides,
            oracle,
            stored,
            layout,
        } = self.device_plan(patches);
        let rearranged = self.layout_scales(&layout, &overrides)?;
        let plan_swap: Vec<bool> = stored
            .iter()
            .map(|b| Self::stored_swap(&overrides, b))
            .collect();
        let stored_refs: Vec<&str> = stored.iter().map(String::as_str).collect();
        self.stored_scales_of(&stored_refs)?;
        self.shared.overrides = overrides;
        for b in self.pinned.drain(..) {
            self.shared.unpin(&b);
        }
        for (b, &swap) in stored.iter().zip(&plan_swap) {
            // the stored bytes as they are (no loader layout fault); a nibble-swap repair on top
            let sc = self.stored_scales.get(b).cloned().flatten();
            self.shared
                .pin_nvfp4(b, sc.as_deref().map(|v| v.as_slice()), swap)?;
            self.pinned.push(b.clone());
        }
        for (b, (sc, swap)) in layout.iter().zip(rearranged) {
            // the reading the linears would resolve one by one, prepared here in parallel
            self.shared.pin_nvfp4(b, Some(&sc), swap)?;
            self.pinned.push(b.clone());
        }
        self.shared.replay = Some(ReplayTrace::new(oracle));
        let refs: Vec<&Tensor> = self.cap.inputs.iter().collect();
        let mut env = PathEnv {
            kind: PathKind::Served,
            shared: &mut self.shared,
        };
        let outputs = crate::probe::prefill::exec(&self.cap.op, &refs, &mut env);
        let trace = self.shared.replay.take().unwrap_or_default();
        let outputs = outputs?;
        let vs_bf16 = Compare::of(&outputs[0].data, &self.cap.oracle_bf16[0].data);
        Ok(Eval {
            outputs,
            vs_bf16,
            obs: trace.obs,
            act_amax: trace.act_amax,
        })
    }
}

/// A patch set as the evaluation applies it.
struct DevicePlan {
    /// `Patch::Ov` as the device linears' overrides (the served reading re-resolves from them).
    overrides: Vec<(String, Override)>,
    /// Weights evaluated in the BF16 oracle's numerics.
    oracle: HashSet<String>,
    /// Quantized, non-oracle weights pinned to their stored block scales (non-finite re-derived).
    stored: Vec<String>,
    /// Other NVFP4 weights with a layout repair (unswizzle, unshift rows): pinned to their
    /// rearranged scale bytes.
    layout: Vec<String>,
}

#[cfg(test)]
impl Replayer<'_> {
    /// The served reading of an NVFP4 base under `patches` exactly as the evaluation sets it up
    /// (its plan, the same `served` functions `Gpu::served_reading`/`pin_nvfp4_served` call, the
    /// repaired stored scales), decoded as the host's pinned reading and the device's
    /// `dequant_nvfp4` decode the served operand (`e2m1 · e4m3(scale byte)`, nibble order as
    /// given). None for a weight evaluated in the BF16 oracle's numerics.
    fn device_reading(
        &mut self,
        patches: &[(String, Patch)],
        base: &str,
    ) -> Result<Option<(Vec<f32>, Nvfp4Params)>> {
        let plan = self.device_plan(patches);
        if plan.oracle.contains(base) || !self.quantized(base) {
            return Ok(None);
        }
        let ckpt = self.shared.ckpt;
        let m = self.meta(base)?;
        let conv = nvfp4_convention(&m).expect("an NVFP4 weight");
        if plan.stored.iter().any(|b| b == base) {
            self.stored_scales_of(&[base])?;
        }
        let faults = crate::served::faults::hitting(&self.shared.faults, base);
        let ovs = served::overrides_of(&plan.overrides, base);
        let lay = ckpt.weight_layout(base)?;
        let stored = || -> Result<Vec<u8>> {
            Ok(ckpt
                .canonical_bytes(lay.scale.as_deref().expect("block scales"))?
                .to_vec())
        };
        let (sc, swap, p) = if plan.stored.iter().any(|b| b == base) {
            let sc = self.stored_scales[base].as_ref().map(|v| v.to_vec());
            let p = served::nvfp4_params_of(ckpt, &m, conv, true, &faults, &ovs);
            (sc, Self::stored_swap(&plan.overrides, base), p)
        } else if plan.layout.iter().any(|b| b == base) {
            // pinned to the bytes `layout_scales` prepares, scalars as `pin_nvfp4_served` resolves
            let (sc, swap) = self
                .layout_scales(&[base.to_string()], &plan.overrides)?
                .remove(0);
            let p = served::nvfp4_params_of(ckpt, &m, conv, true, &faults, &ovs);
            (Some(sc), swap, p)
        } else {
            served::nvfp4_served_bytes(ckpt, &m, conv, true, &faults, &ovs, stored)?
        };
        // decoded by the host evaluator's pinned reading (`served::linears::pinned_nvfp4`)
        let sc = match sc {
            Some(v) => v,
            None => stored()?,
        };
        let lc = served::LinearCtx {
            ckpt,
            profile: self.shared.profile,
            fuse_pairs: true,
            faults: &self.shared.faults,
            overrides: &plan.overrides,
        };
        let wq = match served::linears::pinned_nvfp4(&lc, base, Some(&sc), swap)? {
            served::ServedWeight::Nvfp4 { wq, .. } => wq.to_vec(),
            _ => unreachable!("pinned_nvfp4 returns an NVFP4 reading"),
        };
        Ok(Some((wq, p)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{QuantWeight, WeightFormat};
    use crate::numerics::e2m1;
    use crate::numerics::nvfp4::Convention;
    use crate::served::faults::Fault;
    use crate::served::ServedWeight;

    /// The replay's former host evaluator, kept as the independent reference of the served
    /// readings: each weight decoded to values once, every patch applied to the values.
    struct Decoding<'a> {
        ckpt: &'a Checkpoint,
        faults: Vec<Fault>,
        cache: HashMap<String, Entry>,
    }

    struct Entry {
        qw: QuantWeight,
        /// The served reading with the loader's faults and no patches.
        served: ServedWeight,
    }

    impl<'a> Decoding<'a> {
        fn new(rp: &Replayer<'a>) -> Self {
            Decoding {
                ckpt: rp.shared.ckpt,
                faults: rp.shared.faults.clone(),
                cache: HashMap::new(),
            }
        }

        fn entry(&mut self, base: &str) -> Result<&Entry> {
            if !self.cache.contains_key(base) {
                let qw = self.ckpt.weight(base)?;
                let f32 = qw.dequantize()?.data;
                let faults = crate::served::faults::hitting(&self.faults, base);
                let served = served::prepare(self.ckpt, &qw, &f32, true, &faults, &[])?;
                self.cache.insert(base.to_string(), Entry { qw, served });
            }
            Ok(&self.cache[base])
        }

        /// The parameters as the decoding replay used to read them (the served reading prepared from
        /// the dequantized weight); kept to check [`Replayer::params`] against.
        fn params_decoded(&mut self, base: &str) -> Result<Option<Nvfp4Params>> {
            Ok(match &self.entry(base)?.served {
                ServedWeight::Nvfp4 { p, .. } => Some(*p),
                _ => None,
            })
        }

        /// Build the served weight of `base` under `patches`.
        fn served_with(&mut self, base: &str, patches: &[&Patch]) -> Result<ServedWeight> {
            let faults: Vec<Fault> = crate::served::faults::hitting(&self.faults, base)
                .into_iter()
                .cloned()
                .collect();
            let ckpt = self.ckpt;
            let e = self.entry(base)?;
            let (wq0, p0) = match &e.served {
                ServedWeight::Nvfp4 { wq, p } => (wq, *p),
                ServedWeight::Dense { w } => return Ok(ServedWeight::Dense { w: w.clone() }), // shared
                ServedWeight::Fp8Act {
                    w,
                    non_pow2_act,
                    recipe,
                } => {
                    return Ok(ServedWeight::Fp8Act {
                        w: w.clone(),
                        non_pow2_act: *non_pow2_act,
                        recipe: *recipe,
                    })
                }
            };
            let layout: Vec<Override> = patches
                .iter()
                .filter_map(|p| match p {
                    Patch::Ov(
                        o @ (Override::NibbleSwap | Override::Unswizzle | Override::UnshiftRows),
                    ) => Some(o.clone()),
                    _ => None,
                })
                .collect();
            let stored = patches.iter().any(|p| **p == Patch::StoredBlockScales);
            let mut wq = if stored {
                Arc::new(stored_block_scale_wq(&e.qw)?)
            } else if !layout.is_empty() {
                let fr: Vec<&Fault> = faults.iter().collect();
                match served::prepare(ckpt, &e.qw, &[], true, &fr, &layout)? {
                    ServedWeight::Nvfp4 { wq, .. } => wq,
                    _ => wq0.clone(),
                }
            } else {
                wq0.clone()
            };
            if stored && !layout.is_empty() {
                // layout repairs on top of the stored bytes: only the nibble order applies
                if layout.contains(&Override::NibbleSwap) {
                    wq = Arc::new(swap_pairs_nibbles(&e.qw)?);
                }
            }
            let mut p = p0;
            for pa in patches {
                if let Patch::Ov(o) = pa {
                    p.apply(o);
                }
            }
            Ok(ServedWeight::Nvfp4 { wq, p })
        }
    }

    /// Decode `e2m1 · s_w` straight from the checkpoint's bytes, linear layout, non-finite scale bytes
    /// replaced by the median of their row's finite scales (a NaN byte carries no value to recover).
    fn stored_block_scale_wq(qw: &QuantWeight) -> Result<Vec<f32>> {
        let WeightFormat::Nvfp4 { packed, scales, .. } = &qw.format else {
            return Err(Error::usage(
                "internal: stored block scales of a non-NVFP4 weight",
            ));
        };
        decode_nvfp4(qw, packed, scales, false)
    }

    fn swap_pairs_nibbles(qw: &QuantWeight) -> Result<Vec<f32>> {
        let WeightFormat::Nvfp4 { packed, scales, .. } = &qw.format else {
            return Err(Error::usage("internal: nibble swap of a non-NVFP4 weight"));
        };
        decode_nvfp4(qw, packed, scales, true)
    }

    fn decode_nvfp4(
        qw: &QuantWeight,
        packed: &[u8],
        scales: &[u8],
        swap: bool,
    ) -> Result<Vec<f32>> {
        let (rows, cols) = (qw.out_features, qw.in_features);
        let nb = cols / nvfp4::BLOCK;
        if scales.len() < rows * nb || packed.len() < rows * cols / 2 {
            return Err(Error::bad(
                &qw.file,
                Some(&qw.canonical),
                "NVFP4 bytes shorter than the weight's shape",
            ));
        }
        let mut out = vec![0f32; rows * cols];
        for r in 0..rows {
            let row_sc: Vec<f32> = scales[r * nb..(r + 1) * nb]
                .iter()
                .map(|&b| e4m3::decode(b))
                .collect();
            let mut finite: Vec<f32> = row_sc.iter().copied().filter(|v| v.is_finite()).collect();
            finite.sort_by(|a, b| a.total_cmp(b));
            let med = finite.get(finite.len() / 2).copied().unwrap_or(0.0);
            for (b, &s0) in row_sc.iter().enumerate() {
                let s = if s0.is_finite() { s0 } else { med };
                let base = r * cols + b * nvfp4::BLOCK;
                for i in 0..nvfp4::BLOCK / 2 {
                    let (mut lo, mut hi) = e2m1::unpack(packed[base / 2 + i]);
                    if swap {
                        std::mem::swap(&mut lo, &mut hi);
                    }
                    out[base + 2 * i] = e2m1::decode(lo) * s;
                    out[base + 2 * i + 1] = e2m1::decode(hi) * s;
                }
            }
        }
        Ok(out)
    }
    use crate::checkpoint::Naming;
    use crate::served::faults::FaultKind;
    use crate::synth::{self, Format, Preset, SynthOptions};

    fn ckpt(format: Format, faults: Vec<Fault>) -> Checkpoint {
        let mut o = SynthOptions::new(Preset::Tiny, format, Naming::Official, 3);
        o.faults = faults;
        synth::synth_to_memory(&o).unwrap()
    }

    fn fault(kind: FaultKind, target: &str) -> Fault {
        Fault {
            kind,
            target: target.into(),
        }
    }

    fn replayer<'a>(ck: &'a Checkpoint, faults: Vec<Fault>) -> Replayer<'a> {
        let cfg = ck.model_config().unwrap().clone();
        let op = build_graph(&cfg, 1, false)
            .into_iter()
            .find(|o| o.id == "L1.ffn.experts")
            .unwrap();
        let opts = RunOptions {
            loader_faults: faults,
            ..RunOptions::new((0, 1), crate::probe::synthetic_tokens(8, cfg.vocab_size, 0))
        };
        let cap = Capture {
            op,
            inputs: Vec::new(),
            oracle_bf16: Vec::new(),
        };
        Replayer::new(ck, &opts, cap).unwrap()
    }

    const BASES: [&str; 5] = [
        "layers.1.ffn.experts.0.w1",
        "layers.1.ffn.experts.0.w3",
        "layers.1.ffn.experts.5.w2",
        "layers.1.attn.wq_a",
        "layers.1.attn.wkv",
    ];

    fn loader_faults() -> Vec<Vec<Fault>> {
        let mut v = vec![Vec::new()];
        for k in FaultKind::ALL {
            if k == FaultKind::NonPow2Ue8m0 {
                continue; // FP8 only
            }
            for t in ["L1.ffn.experts", "L1.attn.q_a"] {
                v.push(vec![fault(k, t)]);
            }
        }
        v
    }

    fn bits(p: &Nvfp4Params) -> [u32; 3] {
        [p.g_x.to_bits(), p.d_w.to_bits(), p.alpha.to_bits()]
    }

    /// Hypothesis formation reads headers and scalars only, and gets the parameters the decoding
    /// replay got, under every loader fault, in both NVFP4 conventions.
    #[test]
    fn replay_params_from_metadata_equal_the_decoded_reading() {
        for format in [Format::CtNvfp4, Format::ModelOptNvfp4] {
            let ck = ckpt(format, Vec::new());
            for faults in loader_faults() {
                let mut rp = replayer(&ck, faults.clone());
                let mut dec = Decoding::new(&rp);
                let mut bases: Vec<String> = BASES.iter().map(|s| s.to_string()).collect();
                bases.push("layers.1.attn.wo_a".into()); // BF16: no parameters
                for b in &bases {
                    let b0 = ck.bytes_read();
                    let p = rp.params(b).unwrap();
                    let m = rp.meta(b).unwrap();
                    let read = ck.bytes_read() - b0;
                    assert!(read < 64, "{b}: params read {read} bytes, not only scalars");
                    let d = dec.params_decoded(b).unwrap();
                    assert_eq!(
                        p.map(|p| bits(&p)),
                        d.map(|p| bits(&p)),
                        "{format:?} {faults:?} {b}"
                    );
                    let qw = ck.weight(b).unwrap();
                    assert_eq!(m.tensors, qw.tensors);
                    assert_eq!(m.canonical, qw.canonical);
                }
            }
        }
    }

    /// The byte-level repair of non-finite block scales decodes to the CPU evaluator's
    /// `stored_block_scale_wq`, bit for bit (rows with some, all and no NaN bytes, signed scales).
    #[test]
    fn replay_repaired_scale_bytes_decode_as_the_stored_block_scales() {
        let (rows, cols) = (6, 64);
        let nb = cols / nvfp4::BLOCK;
        let mut st = 12345u64;
        let mut rnd = || {
            st = st
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (st >> 33) as u8
        };
        let packed: Vec<u8> = (0..rows * cols / 2).map(|_| rnd()).collect();
        let mut scales: Vec<u8> = (0..rows * nb).map(|_| rnd() & 0x7E).collect();
        scales[0] = 0x7F; // row 0: one NaN
        scales[nb + 1] = 0xFF; // row 1: NaN among negatives
        for b in &mut scales[nb..2 * nb] {
            *b |= 0x80;
        }
        scales[nb + 1] = 0xFF;
        for b in &mut scales[2 * nb..3 * nb] {
            *b = 0x7F; // row 2: all NaN
        }
        scales[3 * nb + 2] = 0x00; // row 3: zeros, finite
        scales[4 * nb] = 0x80; // row 4: -0 and a NaN
        scales[4 * nb + 3] = 0xFF;
        let qw = QuantWeight {
            canonical: "w".into(),
            out_features: rows,
            in_features: cols,
            format: WeightFormat::Nvfp4 {
                packed: packed.clone(),
                scales: scales.clone(),
                convention: Convention::ModelOpt,
                weight_global: 1.0,
                input_global: Some(1.0),
            },
            tensors: crate::checkpoint::WeightTensors {
                weight: "w.weight".into(),
                block_scale: None,
                global_scale: None,
                input_scale: None,
            },
            file: "mem".into(),
        };
        let want = stored_block_scale_wq(&qw).unwrap();
        let fixed = repaired_scale_bytes(&scales, rows, nb).expect("NaN bytes present");
        assert!(fixed.iter().all(|&b| e4m3::decode(b).is_finite()));
        for (i, w) in want.iter().enumerate() {
            let (lo, hi) = e2m1::unpack(packed[i / 2]);
            let code = if i % 2 == 0 { lo } else { hi };
            let got = e2m1::decode(code) * e4m3::decode(fixed[i / nvfp4::BLOCK]);
            assert_eq!(got.to_bits(), w.to_bits(), "element {i}");
        }
        let clean: Vec<u8> = scales.iter().map(|&b| b & 0x7E).collect();
        assert!(repaired_scale_bytes(&clean, rows, nb).is_none());
    }

    /// Every kind of patch the hypotheses make (scalar overrides, nibble swap, unswizzle, unshift,
    /// stored block scales alone and with a swap, oracle), under every loader fault and with NaN
    /// bytes in the checkpoint: the served reading the CUDA evaluator sets up from bytes and
    /// scalars decodes to the CPU evaluator's `served_with`, bit for bit, with the same
    /// parameters; oracle patches and unquantized weights go to the oracle numerics on both.
    #[test]
    fn replay_device_reading_equals_the_cpu_served_weight() {
        let sets = |b: &str| -> Vec<Vec<(String, Patch)>> {
            let p = |x: Patch| (b.to_string(), x);
            vec![
                vec![],
                vec![
                    p(Patch::Ov(Override::InputEncode(0.37))),
                    p(Patch::Ov(Override::Alpha(1.7e-3))),
                ],
                vec![
                    p(Patch::Ov(Override::WeightDecode(2.5e-3))),
                    p(Patch::Ov(Override::Alpha(0.21))),
                ],
                vec![p(Patch::Ov(Override::Alpha(3.0)))],
                vec![p(Patch::Ov(Override::NibbleSwap))],
                vec![p(Patch::Ov(Override::Unswizzle))],
                vec![p(Patch::Ov(Override::UnshiftRows))],
                vec![p(Patch::StoredBlockScales)],
                vec![
                    p(Patch::StoredBlockScales),
                    p(Patch::Ov(Override::NibbleSwap)),
                ],
                vec![p(Patch::Oracle)],
                vec![p(Patch::Oracle), p(Patch::StoredBlockScales)],
            ]
        };
        let (mut cases, mut repaired) = (0, 0);
        for format in [Format::CtNvfp4, Format::ModelOptNvfp4] {
            let ckpts = [
                (ckpt(format, Vec::new()), loader_faults()),
                (
                    ckpt(
                        format,
                        vec![
                            fault(FaultKind::NanBlockScale, "L1.ffn.experts"),
                            fault(FaultKind::NanBlockScale, "L1.attn.q_a"),
                        ],
                    ),
                    vec![
                        Vec::new(),
                        vec![fault(FaultKind::NibbleSwap, "L1.ffn.experts")],
                    ],
                ),
            ];
            for (ck, fault_sets) in &ckpts {
                for faults in fault_sets {
                    let mut rp = replayer(ck, faults.clone());
                    let mut dec = Decoding::new(&rp);
                    for b in BASES {
                        for patches in sets(b) {
                            let mine: Vec<&Patch> = patches.iter().map(|(_, p)| p).collect();
                            let cpu = if mine.contains(&&Patch::Oracle) {
                                None
                            } else {
                                match dec.served_with(b, &mine).unwrap() {
                                    ServedWeight::Nvfp4 { wq, p } => Some((wq, p)),
                                    _ => panic!("{b} is NVFP4"),
                                }
                            };
                            let dev = rp.device_reading(&patches, b).unwrap();
                            let what = format!("{format:?} {faults:?} {b} {patches:?}");
                            match (cpu, dev) {
                                (None, None) => {}
                                (Some((cw, cp)), Some((dw, dp))) => {
                                    assert_eq!(bits(&cp), bits(&dp), "{what}");
                                    assert_eq!(cw.len(), dw.len(), "{what}");
                                    let bad = cw
                                        .iter()
                                        .zip(&dw)
                                        .position(|(a, b)| a.to_bits() != b.to_bits());
                                    assert_eq!(bad, None, "{what}");
                                }
                                (c, d) => panic!(
                                    "{what}: cpu oracle {} device oracle {}",
                                    c.is_none(),
                                    d.is_none()
                                ),
                            }
                            cases += 1;
                        }
                    }
                    repaired += rp.stored_scales.values().filter(|v| v.is_some()).count();
                }
            }
        }
        // the NaN-byte checkpoints exercised the repaired-bytes path
        assert!(repaired > 0);
        assert!(cases > 1000, "{cases}");
    }

    /// What the replay records, through the runner's environment, against values computed here
    /// from the captured inputs (the built-in model: FP8 `wo_a`, quantized experts): a grouped
    /// projection is observed group by group as `{op}.g{g}`, a linear under its op id, the
    /// routed experts per used expert as w1, w3, w2; each base's activation amax is the amax of
    /// what the op fed it; with every weight patched to the oracle nothing is observed, the
    /// amaxes stay, and the op replays the captured BF16 oracle bit for bit.
    #[test]
    fn replay_records_observation_ids_and_activation_amax() {
        let ck = synth::builtin(0).unwrap();
        let cfg = ck.model_config().unwrap().clone();
        let opts = RunOptions::new(
            (0, 1),
            crate::probe::synthetic_tokens(16, cfg.vocab_size, 2),
        );
        let amax = |x: &[f32]| x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let ids = |ev: &Eval| -> Vec<(String, String)> {
            ev.obs
                .iter()
                .map(|(s, b, _)| (s.clone(), b.clone()))
                .collect()
        };
        let bits = |ts: &[Tensor]| -> Vec<Vec<u32>> {
            ts.iter()
                .map(|t| t.data.iter().map(|v| v.to_bits()).collect())
                .collect()
        };
        // (sub id, base) in call order; per base, the amax it was fed (None: not checked)
        type Expected = (Vec<(String, String)>, Vec<(String, Option<f32>)>);
        for op_id in ["L1.attn.wo_a", "L1.attn.q_a", "L1.ffn.experts"] {
            let cap = capture(&ck, &opts, op_id).unwrap();
            let x = &cap.inputs[0];
            let d = x.cols();
            let bases = cap.op.weights.clone();
            let (want_ids, want_amax): Expected = match op_id {
                "L1.attn.wo_a" => (
                    (0..cfg.o_groups)
                        .map(|g| (format!("{op_id}.g{g}"), bases[0].clone()))
                        .collect(),
                    vec![(bases[0].clone(), Some(amax(&x.data)))],
                ),
                "L1.attn.q_a" => (
                    vec![(op_id.to_string(), bases[0].clone())],
                    vec![(bases[0].clone(), Some(amax(&x.data)))],
                ),
                _ => {
                    let (idx, k) = (&cap.inputs[2], cfg.num_experts_per_tok);
                    let mut rows: Vec<Vec<usize>> = vec![Vec::new(); cfg.n_routed_experts];
                    for (i, &e) in idx.data.iter().enumerate() {
                        rows[e as usize].push(i / k);
                    }
                    let (mut ids, mut am) = (Vec::new(), Vec::new());
                    for (e, r) in rows.iter().enumerate().filter(|(_, r)| !r.is_empty()) {
                        let fed = r
                            .iter()
                            .map(|&t| amax(&x.data[t * d..(t + 1) * d]))
                            .fold(0f32, f32::max);
                        for (j, w) in ["w1", "w3", "w2"].iter().enumerate() {
                            let b = bases[3 * e + j].clone();
                            ids.push((format!("L1.ffn.expert.{e}.{w}"), b.clone()));
                            am.push((b, (j < 2).then_some(fed)));
                        }
                    }
                    (ids, am)
                }
            };
            assert!(want_amax
                .iter()
                .all(|(b, _)| ck.weight_scheme(b).is_some_and(|s| s != "bf16")));
            let mut rp = Replayer::new(&ck, &opts, cap.clone()).unwrap();
            let all_oracle: Vec<(String, Patch)> = want_amax
                .iter()
                .map(|(b, _)| (b.clone(), Patch::Oracle))
                .collect();
            let served = rp.eval(&[]).unwrap();
            let oracle = rp.eval(&all_oracle).unwrap();
            assert_eq!(ids(&served), want_ids, "{op_id}");
            assert!(oracle.obs.is_empty(), "{op_id}");
            for ev in [&served, &oracle] {
                assert_eq!(ev.act_amax.len(), want_amax.len(), "{op_id}");
                for (b, a) in &want_amax {
                    let got = ev.act_amax[b];
                    match a {
                        Some(a) => assert_eq!(got.to_bits(), a.to_bits(), "{op_id} {b}"),
                        None => assert!(got.is_finite() && got > 0.0, "{op_id} {b}: {got}"),
                    }
                }
            }
            assert_eq!(bits(&oracle.outputs), bits(&cap.oracle_bf16), "{op_id}");
            assert_ne!(bits(&served.outputs), bits(&cap.oracle_bf16), "{op_id}");
        }
    }
}
