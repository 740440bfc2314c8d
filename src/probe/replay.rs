//! Replay one op: capture what the BF16 oracle feeds it (running only the oracle path over the
//! prefix, keeping only the tensors the op consumes), then evaluate the op's served numerics on
//! those inputs under any number of hypotheses. Each hypothesis costs one op, not one run.
//!
//! The replay has its own `OpEnv` instead of `probe::env::PathEnv` so that it can keep the decoded
//! weights across hypotheses (the runner's cache holds one served reading per weight and op) and so
//! that it can apply repairs no `Override` expresses: block scales re-read from the checkpoint
//! bytes, and whole weights swapped for the oracle's (to localise the culprit weight of a fused op).

use std::collections::HashMap;
use std::sync::Arc;

use crate::checkpoint::{Checkpoint, QuantWeight, WeightFormat};
use crate::metrics::Compare;
use crate::model::exec::{exec, OpEnv};
use crate::model::graph::{build_graph, Op};
use crate::model::ModelConfig;
use crate::numerics::{bf16, e2m1, e4m3, nvfp4};
use crate::probe::env::{PathEnv, PathKind};
use crate::probe::faults::Fault;
use crate::probe::served::{self, LinearObs, Nvfp4Params, Override, Profile, ServedWeight};
use crate::probe::RunOptions;
use crate::{Error, Result, Tensor};

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

struct Entry {
    qw: QuantWeight,
    /// BF16 oracle weight.
    bf16: Arc<Vec<f32>>,
    /// The served reading with the loader's faults and no patches.
    served: ServedWeight,
}

/// Re-evaluates one captured op's served numerics under patches, reusing the decoded weights.
pub struct Replayer<'a> {
    pub ckpt: &'a Checkpoint,
    pub cfg: ModelConfig,
    pub tokens: Vec<u32>,
    pub profile: Profile,
    pub faults: Vec<Fault>,
    pub cap: Capture,
    cache: HashMap<String, Entry>,
}

impl<'a> Replayer<'a> {
    pub fn new(ckpt: &'a Checkpoint, opts: &RunOptions, cap: Capture) -> Result<Self> {
        Ok(Replayer {
            ckpt,
            cfg: ckpt.model_config()?.clone(),
            tokens: opts.tokens.clone(),
            profile: opts.profile,
            faults: opts.loader_faults.clone(),
            cap,
            cache: HashMap::new(),
        })
    }

    fn entry(&mut self, base: &str) -> Result<&Entry> {
        if !self.cache.contains_key(base) {
            let qw = self.ckpt.weight(base)?;
            let f32 = qw.dequantize()?.data;
            let faults: Vec<&Fault> = self.faults.iter().filter(|f| f.hits(base)).collect();
            let served = served::prepare(self.ckpt, &qw, &f32, true, &faults, &[])?;
            let bf16 = Arc::new(f32.iter().map(|&v| bf16::round(v)).collect());
            self.cache
                .insert(base.to_string(), Entry { qw, bf16, served });
        }
        Ok(&self.cache[base])
    }

    /// The loaded weight of a base (checkpoint tensors, stored scalars).
    pub fn quant_weight(&mut self, base: &str) -> Result<QuantWeight> {
        Ok(self.entry(base)?.qw.clone())
    }

    /// The loader's NVFP4 parameters of a base (faults applied), if it is NVFP4.
    pub fn params(&mut self, base: &str) -> Result<Option<Nvfp4Params>> {
        Ok(match &self.entry(base)?.served {
            ServedWeight::Nvfp4 { p, .. } => Some(*p),
            _ => None,
        })
    }

    /// Build the served weight of `base` under `patches`.
    fn served_with(&mut self, base: &str, patches: &[&Patch]) -> Result<ServedWeight> {
        let faults: Vec<Fault> = self
            .faults
            .iter()
            .filter(|f| f.hits(base))
            .cloned()
            .collect();
        let ckpt = self.ckpt;
        let e = self.entry(base)?;
        let (wq0, p0) = match &e.served {
            ServedWeight::Nvfp4 { wq, p } => (wq, *p),
            ServedWeight::Dense { w } => return Ok(ServedWeight::Dense { w: w.clone() }), // shared
            ServedWeight::Fp8Act { w, non_pow2_act } => {
                return Ok(ServedWeight::Fp8Act {
                    w: w.clone(),
                    non_pow2_act: *non_pow2_act,
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

    /// Evaluate the op's served numerics with `patches` on (base, patch) pairs.
    pub fn eval(&mut self, patches: &[(String, Patch)]) -> Result<Eval> {
        let cap = self.cap.clone();
        let mut env = ReplayEnv {
            r: self,
            patches,
            prepared: HashMap::new(),
            obs: Vec::new(),
            act_amax: HashMap::new(),
        };
        let refs: Vec<&Tensor> = cap.inputs.iter().collect();
        let outputs = exec(&cap.op, &refs, &mut env)?;
        let (obs, act_amax) = (env.obs, env.act_amax);
        let vs_bf16 = Compare::of(&outputs[0].data, &cap.oracle_bf16[0].data);
        Ok(Eval {
            outputs,
            vs_bf16,
            obs,
            act_amax,
        })
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

fn decode_nvfp4(qw: &QuantWeight, packed: &[u8], scales: &[u8], swap: bool) -> Result<Vec<f32>> {
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

enum Prepared {
    Oracle(Arc<Vec<f32>>),
    Served(ServedWeight),
}

struct ReplayEnv<'r, 'a, 'p> {
    r: &'r mut Replayer<'a>,
    patches: &'p [(String, Patch)],
    prepared: HashMap<String, Prepared>,
    obs: Vec<(String, String, LinearObs)>,
    act_amax: HashMap<String, f32>,
}

impl ReplayEnv<'_, '_, '_> {
    fn prepare(&mut self, base: &str) -> Result<()> {
        if self.prepared.contains_key(base) {
            return Ok(());
        }
        let mine: Vec<&Patch> = self
            .patches
            .iter()
            .filter(|(b, _)| b == base)
            .map(|(_, p)| p)
            .collect();
        let quantized = self
            .r
            .ckpt
            .weight_scheme(base)
            .is_some_and(|s| s != "bf16" && s != "f16" && s != "f32");
        let p = if mine.contains(&&Patch::Oracle) || !quantized {
            // unquantized weights are a BF16 GEMM on every path but the FP32 oracle
            Prepared::Oracle(self.r.entry(base)?.bf16.clone())
        } else {
            Prepared::Served(self.r.served_with(base, &mine)?)
        };
        self.prepared.insert(base.to_string(), p);
        Ok(())
    }

    fn note_amax(&mut self, base: &str, x: &[f32]) {
        let a = x.iter().fold(0f32, |a, v| a.max(v.abs()));
        let e = self.act_amax.entry(base.to_string()).or_insert(0.0);
        *e = e.max(a);
    }

    fn gemm(
        &mut self,
        sub_id: &str,
        base: &str,
        x: &[f32],
        m: usize,
        row0: usize,
        n_rows: Option<usize>,
    ) -> Result<(Vec<f32>, usize)> {
        self.prepare(base)?;
        let (n_all, k) = {
            let qw = &self.r.entry(base)?.qw;
            (qw.out_features, qw.in_features)
        };
        let n = n_rows.unwrap_or(n_all);
        if x.len() != m * k || row0 + n > n_all {
            return Err(Error::bad(
                self.r.ckpt.location(),
                Some(base),
                format!(
                    "weight has {k} input features but the activation has {} per row",
                    x.len() / m.max(1)
                ),
            ));
        }
        self.note_amax(base, x);
        let profile = self.r.profile;
        let y = match &self.prepared[base] {
            Prepared::Oracle(w) => served::matmul_nt(x, &w[row0 * k..(row0 + n) * k], m, k, n),
            Prepared::Served(sw) => {
                let sub;
                let sw = if n_rows.is_some() {
                    sub = sw.rows(row0, n, k);
                    &sub
                } else {
                    sw
                };
                let (y, obs) = served::apply(sw, profile, x, m, k, n);
                self.obs.push((sub_id.to_string(), base.to_string(), obs));
                y
            }
        };
        Ok((y, n))
    }
}

impl OpEnv for ReplayEnv<'_, '_, '_> {
    fn cfg(&self) -> &ModelConfig {
        &self.r.cfg
    }
    fn token_ids(&self) -> &[u32] {
        &self.r.tokens
    }
    fn param(&mut self, canonical: &str) -> Result<Tensor> {
        self.r.ckpt.tensor_f32(canonical)
    }
    fn embed_rows(&mut self, ids: &[u32]) -> Result<Tensor> {
        self.r.ckpt.embedding_rows(ids)
    }
    fn linear(&mut self, sub_id: &str, x: &Tensor, base: &str) -> Result<Tensor> {
        let m = x.rows();
        let (y, n) = self.gemm(sub_id, base, &x.data, m, 0, None)?;
        Ok(x.with_last_dim(n, y))
    }
    fn linear_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor> {
        let k = x.cols();
        let rows = x.numel() / (groups * k).max(1);
        let n = self.r.entry(base)?.qw.out_features;
        if n % groups != 0 {
            return Err(Error::bad(
                self.r.ckpt.location(),
                Some(base),
                format!("grouped projection: {n} outputs do not split into {groups} groups"),
            ));
        }
        let r = n / groups;
        let out = crate::probe::served::grouped(&x.data, rows, groups, k, r, |g, xg| {
            Ok(self
                .gemm(&format!("{sub_id}.g{g}"), base, xg, rows, g * r, Some(r))?
                .0)
        })?;
        Ok(Tensor::new(vec![rows, groups, r], out))
    }
    fn store(&self, t: &mut Tensor) {
        t.round_bf16();
    }
}
