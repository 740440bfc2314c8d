//! The three numerics paths as `OpEnv`s over one checkpoint. Weights are read from the checkpoint
//! when an op first needs them and dropped when the op is done (`WeightCache::clear`), so memory is
//! bounded by one op's weights plus the activations still to be consumed.

use std::collections::HashMap;

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, WeightFormat};
use crate::device::Device;
use crate::model::exec::OpEnv;
use crate::model::ModelConfig;
use crate::numerics::nvfp4::QuantHealth;
use crate::served::faults::Fault;
use crate::served::{LinearCtx, LinearObs, Linears, Observed, Override, PathKind, Profile};
use crate::{Result, Tensor};

/// Everything the paths share: the checkpoint, tokens, the per-op weight cache, served options.
pub struct Shared<'a> {
    pub ckpt: &'a Checkpoint,
    pub cfg: ModelConfig,
    pub tokens: Vec<u32>,
    pub profile: Profile,
    pub fuse_pairs: bool,
    pub faults: Vec<Fault>,
    /// Bisect's hypothesis, applied to one weight base.
    pub overrides: Vec<(String, Override)>,
    /// Where the linears run (the backend's `served::Linears`): weights read for the op and
    /// dropped after it.
    linears: Box<dyn Linears>,
    /// Served linears observed during the current op: sub id → observation.
    pub observed: Vec<(String, LinearObs)>,
    /// Weight bases touched during the current op (for reports and bisect), in first-touch order.
    pub touched: Vec<String>,
    /// The same bases as a set: an experts op touches hundreds of weights on every path.
    touched_set: std::collections::HashSet<String>,
    pub record_observations: bool,
    /// Per routed-experts op deferred on the device this op (in order): whether its served
    /// observations are recorded once it is flushed ([`Shared::flush_experts`]).
    deferred_record: Vec<bool>,
    /// Where the layer's other ops, parameters and statistics run ([`Shared::set_backend`]).
    backend: Backend,
    /// Query tokens per attention call (`--chunk`, `OpEnv::chunk_rows`).
    pub chunk: Option<usize>,
    /// Parameters (norm weights, mixing tables, tid2eid, ...) read during the current op: every
    /// path of the op reads the same values, so they come from the checkpoint once per op.
    params: HashMap<String, Tensor>,
}

impl<'a> Shared<'a> {
    pub fn new(ckpt: &'a Checkpoint, cfg: ModelConfig, tokens: Vec<u32>, profile: Profile) -> Self {
        Shared {
            ckpt,
            cfg,
            tokens,
            profile,
            fuse_pairs: true,
            faults: Vec::new(),
            overrides: Vec::new(),
            linears: Backend::Cpu.linears(),
            observed: Vec::new(),
            touched: Vec::new(),
            touched_set: Default::default(),
            params: HashMap::new(),
            record_observations: false,
            deferred_record: Vec::new(),
            backend: Backend::Cpu,
            chunk: None,
        }
    }

    /// Run the paths on `backend` (the CPU until set).
    pub fn set_backend(&mut self, backend: Backend) {
        self.linears = backend.linears();
        self.backend = backend;
    }

    /// Call the linears with the run's checkpoint, profile, faults and hypotheses.
    fn with_linears<R>(&mut self, f: impl FnOnce(&mut dyn Linears, &LinearCtx) -> R) -> R {
        let ctx = LinearCtx {
            ckpt: self.ckpt,
            profile: self.profile,
            fuse_pairs: self.fuse_pairs,
            faults: &self.faults,
            overrides: &self.overrides,
        };
        f(&mut *self.linears, &ctx)
    }

    fn touch(&mut self, base: &str) {
        if !self.touched_set.contains(base) {
            self.touched_set.insert(base.to_string());
            self.touched.push(base.to_string());
        }
    }

    /// Keep a linear's observations (each under `sub_id` + its suffix) when the run records them.
    fn observe(&mut self, sub_id: &str, obs: Observed) {
        if self.record_observations {
            self.observed.extend(
                obs.into_iter()
                    .map(|(sfx, o)| (format!("{sub_id}{sfx}"), o)),
            );
        }
    }

    /// Run the routed-experts ops deferred on the device during this op (`Gpu::defer_experts`),
    /// interleaved, and record the served observations of those that asked for it.
    pub fn flush_experts(&mut self) -> crate::Result<()> {
        let flags = std::mem::take(&mut self.deferred_record);
        let obs = self.with_linears(|l, ctx| l.flush_experts(ctx))?;
        for (o, rec) in obs.into_iter().zip(flags) {
            if rec {
                self.observed.extend(o);
            }
        }
        Ok(())
    }

    /// Drop every cached weight (called between ops).
    pub fn clear(&mut self) {
        self.linears.clear();
        self.params.clear();
        self.observed.clear();
        self.touched.clear();
        self.touched_set.clear();
    }

    /// True when the weight is stored in a quantized format (its served numerics differ from the BF16 oracle).
    pub fn is_quantized(&self, base: &str) -> bool {
        self.ckpt
            .weight_scheme(base)
            .map(|s| s != "bf16" && s != "f16" && s != "f32")
            .unwrap_or(false)
    }
}

/// One path's environment for `model::exec`.
pub struct PathEnv<'s, 'a> {
    pub kind: PathKind,
    pub shared: &'s mut Shared<'a>,
}

impl OpEnv for PathEnv<'_, '_> {
    fn cfg(&self) -> &ModelConfig {
        &self.shared.cfg
    }
    fn weight_file(&self, name: &str) -> Option<std::path::PathBuf> {
        Some(self.shared.ckpt.file_of(name))
    }
    fn token_ids(&self) -> &[u32] {
        &self.shared.tokens
    }
    fn param(&mut self, canonical: &str) -> Result<Tensor> {
        if let Some(t) = self.shared.params.get(canonical) {
            return Ok(t.clone());
        }
        let _s = crate::profile::span("host: param read");
        let t = self.shared.ckpt.tensor_f32(canonical)?;
        self.shared.params.insert(canonical.to_string(), t.clone());
        Ok(t)
    }
    fn param_dev(&mut self, canonical: &str) -> Result<Tensor> {
        self.param(canonical)?;
        let cached = &self.shared.params[canonical];
        // attached to the cached tensor: the op's other paths get it with their clones
        self.shared.backend.make_resident(&cached.data)?;
        Ok(cached.clone())
    }
    fn param_rows(&mut self, canonical: &str, ids: &[u32]) -> Result<Tensor> {
        // the runner's token ids are those of the whole run: one entry per parameter
        let key = format!("{canonical} rows");
        if let Some(t) = self.shared.params.get(&key) {
            return Ok(t.clone());
        }
        let _s = crate::profile::span("host: param read");
        let t = self
            .shared
            .ckpt
            .tensor_rows(canonical, ids, "a routing table")?;
        self.shared.params.insert(key, t.clone());
        Ok(t)
    }
    fn embed_rows(&mut self, ids: &[u32]) -> Result<Tensor> {
        self.shared.ckpt.embedding_rows(ids)
    }
    fn linear(&mut self, sub_id: &str, x: &Tensor, base: &str) -> Result<Tensor> {
        let (kind, m) = (self.kind, x.rows());
        let (y, n, obs) = self
            .shared
            .with_linears(|l, ctx| l.linear(ctx, kind, base, &x.data, m))?;
        self.shared.touch(base);
        self.shared.observe(sub_id, obs);
        Ok(x.with_last_dim(n, y))
    }
    fn linear_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor> {
        // x [rows, G, K]; weight [G·R, K]: group g uses rows g·R..(g+1)·R
        let rows = x.numel() / (groups * x.cols()).max(1);
        let kind = self.kind;
        let (y, r, obs) = self
            .shared
            .with_linears(|l, ctx| l.linear_grouped(ctx, kind, base, &x.data, rows, groups))?;
        self.shared.touch(base);
        self.shared.observe(sub_id, obs);
        Ok(Tensor::new(vec![rows, groups, r], y))
    }
    fn store(&self, t: &mut Tensor) {
        if self.kind == PathKind::OracleFp32 || t.data.known_bf16_exact() == Some(true) {
            return;
        }
        // values only on the device are rounded there (no trip through the host)
        if self.shared.backend.round_resident(&mut t.data) {
            return;
        }
        let _s = crate::profile::span("host: store round_bf16");
        t.round_bf16();
    }
    fn experts_fused(
        &mut self,
        layer: usize,
        x: &Tensor,
        per: &[Vec<(usize, f32)>],
        k: usize,
        bases: &[&str],
        limit: f32,
    ) -> Option<Result<Tensor>> {
        let kind = self.kind;
        let sh = &mut *self.shared;
        if sh.linears.deferring() {
            // its observations come with the flush
            let rec = sh.record_observations && kind == PathKind::Served;
            sh.deferred_record.push(rec);
        }
        let observe = kind == PathKind::Served;
        let r = sh
            .with_linears(|l, ctx| l.experts(ctx, kind, layer, x, per, k, bases, limit, observe))?;
        Some(r.map(|(y, obs, touched, _)| {
            for b in touched {
                sh.touch(&b);
            }
            if sh.record_observations {
                sh.observed.extend(obs);
            }
            y
        }))
    }
    fn chunk_rows(&self) -> Option<usize> {
        self.shared.chunk
    }
    fn device(&self) -> Box<dyn Device + '_> {
        let store = move |t: &mut Tensor| self.store(t);
        (self.shared.backend).device(self.kind != PathKind::OracleFp32, store)
    }
}

/// Sum of the health counters of an op's served linears and the worst activation-over-calibration ratio.
pub fn aggregate_health(obs: &[(String, LinearObs)]) -> (Option<QuantHealth>, Option<f64>) {
    let mut h: Option<QuantHealth> = None;
    let mut worst: Option<f64> = None;
    for (_, o) in obs {
        if let Some(x) = &o.health {
            h.get_or_insert_with(QuantHealth::default).add(x);
        }
        if let Some(r) = o.act_amax_over_calib {
            worst = Some(worst.map_or(r, |w: f64| w.max(r)));
        }
    }
    (h, worst)
}

/// Helper for reports: the format name of a weight format.
pub fn format_name(f: &WeightFormat) -> &'static str {
    f.scheme().spec().family
}

/// The per-op hooks of the run's linears (`served::Linears::begin_op`, `cancel_op`).
impl Shared<'_> {
    /// Op `op` is about to run on every path: its weights preloaded where the machine batches
    /// them, a routed-experts op deferred (true) until [`Shared::flush_experts`].
    pub fn begin_op(&mut self, op: &crate::model::graph::Op) -> Result<bool> {
        self.with_linears(|l, ctx| l.begin_op(ctx, op))
    }

    /// The op failed midway: drop what it left deferred, so the state can run again.
    pub fn cancel_op(&mut self) {
        self.linears.cancel_op();
    }
}

#[cfg(test)]
mod param_cache_tests {
    use super::*;
    use crate::model::exec::OpEnv;

    #[test]
    fn the_paths_of_one_op_read_a_parameter_once_and_get_the_same_values() {
        let ck = crate::synth::builtin(0).expect("built-in model");
        let cfg = ck.model_config().expect("config").clone();
        let name = "layers.0.attn_norm.weight";
        let direct = ck.tensor_f32(name).expect("param");
        let mut sh = Shared::new(&ck, cfg, vec![1, 2, 3], Profile::BlackwellW4a4);
        let b0 = ck.bytes_read();
        for kind in PathKind::ALL {
            let mut env = PathEnv {
                kind,
                shared: &mut sh,
            };
            let t = env.param(name).expect("param");
            assert_eq!(t.shape, direct.shape);
            assert_eq!(&t.data[..], &direct.data[..], "{kind:?}");
        }
        let once = ck.bytes_read() - b0;
        assert!(once > 0, "the first path reads it from the checkpoint");
        // the next op reads it again
        sh.clear();
        let mut env = PathEnv {
            kind: PathKind::Served,
            shared: &mut sh,
        };
        env.param(name).expect("param");
        assert_eq!(ck.bytes_read() - b0, 2 * once);
    }
}
