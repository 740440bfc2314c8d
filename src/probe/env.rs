//! The three numerics paths as `OpEnv`s over one checkpoint. Weights are read from the checkpoint
//! when an op first needs them and dropped when the op is done (`WeightCache::clear`), so memory is
//! bounded by one op's weights plus the activations still to be consumed.

use std::collections::HashMap;
use std::sync::Arc;

use crate::backend::cuda::LinearCtx;
use crate::backend::layer::{CudaDevice, Dev};
use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, QuantWeight, WeightFormat};
use crate::device::{CpuDevice, Device};
use crate::model::exec::OpEnv;
use crate::model::ModelConfig;
use crate::numerics::nvfp4::QuantHealth;
use crate::served::faults::Fault;
use crate::served::PathKind;
use crate::served::{self, LinearObs, Override, Profile, ServedWeight};
use crate::tensor::Data;
use crate::{Result, Tensor};

struct Cached {
    qw: QuantWeight,
    f32: Arc<Vec<f32>>,
    bf16: Option<Arc<Vec<f32>>>,
    served: Option<Arc<ServedWeight>>,
}

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
    cache: HashMap<String, Cached>,
    /// Approximate bytes held by `cache`; past `cache_budget` the cache is emptied before the next load,
    /// so an op over hundreds of experts stays bounded (each path then re-reads what it needs).
    cache_bytes: usize,
    pub cache_budget: usize,
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
    /// Where linears, routed experts and statistics run.
    pub backend: Backend,
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
            cache: HashMap::new(),
            cache_bytes: 0,
            cache_budget: 4 << 30,
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

    /// The run's checkpoint, profile, faults and hypotheses as the device linears need them.
    fn linear_ctx(&self) -> LinearCtx<'_> {
        LinearCtx {
            ckpt: self.ckpt,
            profile: self.profile,
            fuse_pairs: self.fuse_pairs,
            faults: &self.faults,
            overrides: &self.overrides,
        }
    }

    fn touch(&mut self, base: &str) {
        if !self.touched_set.contains(base) {
            self.touched_set.insert(base.to_string());
            self.touched.push(base.to_string());
        }
    }

    fn observe(&mut self, sub_id: String, obs: Option<LinearObs>) {
        if let Some(o) = obs {
            if self.record_observations {
                self.observed.push((sub_id, o));
            }
        }
    }

    /// Run the routed-experts ops deferred on the device during this op (`Gpu::defer_experts`),
    /// interleaved, and record the served observations of those that asked for it.
    pub fn flush_experts(&mut self) -> crate::Result<()> {
        let flags = std::mem::take(&mut self.deferred_record);
        let Some(g) = self.backend.gpu().cloned() else {
            return Ok(());
        };
        let obs = lock(&g)?.experts_flush(&self.linear_ctx())?;
        for (o, rec) in obs.into_iter().zip(flags) {
            if rec {
                self.observed.extend(o);
            }
        }
        Ok(())
    }

    /// Drop every cached weight (called between ops).
    pub fn clear(&mut self) {
        if let Some(g) = self.backend.gpu() {
            if let Ok(mut g) = g.lock() {
                g.clear_weights();
            }
        }
        self.cache.clear();
        self.cache_bytes = 0;
        self.params.clear();
        self.observed.clear();
        self.touched.clear();
        self.touched_set.clear();
    }

    fn load(&mut self, base: &str) -> Result<&mut Cached> {
        if !self.cache.contains_key(base) {
            let qw = self.ckpt.weight(base)?;
            let f32 = Arc::new(qw.dequantize()?.data.into_vec());
            // f32 dequant + BF16 or served copy + the stored bytes, roughly
            let size = f32.len() * 4 * 3;
            if self.cache_bytes + size > self.cache_budget && !self.cache.is_empty() {
                self.cache.clear();
                self.cache_bytes = 0;
            }
            self.cache_bytes += size;
            self.cache.insert(
                base.to_string(),
                Cached {
                    qw,
                    f32,
                    bf16: None,
                    served: None,
                },
            );
            self.touch(base);
        }
        Ok(self.cache.get_mut(base).expect("inserted above"))
    }

    fn weight_for(
        &mut self,
        kind: PathKind,
        base: &str,
    ) -> Result<(Arc<WeightView>, usize, usize)> {
        let profile = self.profile;
        let fuse = self.fuse_pairs;
        let faults: Vec<Fault> = crate::served::faults::hitting(&self.faults, base)
            .into_iter()
            .cloned()
            .collect();
        let overrides = served::overrides_of(&self.overrides, base);
        let ckpt = self.ckpt;
        let c = self.load(base)?;
        let (n, k) = (c.qw.out_features, c.qw.in_features);
        let view = match kind {
            PathKind::OracleFp32 => WeightView::F32(c.f32.clone()),
            PathKind::OracleBf16 => {
                if c.bf16.is_none() {
                    c.bf16 = Some(Arc::new(
                        c.f32
                            .iter()
                            .map(|&v| crate::numerics::bf16::round(v))
                            .collect(),
                    ));
                }
                WeightView::F32(c.bf16.clone().expect("set above"))
            }
            PathKind::Served => {
                if c.served.is_none() {
                    let fr: Vec<&Fault> = faults.iter().collect();
                    c.served = Some(Arc::new(served::prepare(
                        ckpt, &c.qw, &c.f32, fuse, &fr, &overrides,
                    )?));
                }
                WeightView::Served(c.served.clone().expect("set above"), profile)
            }
        };
        Ok((Arc::new(view), n, k))
    }

    /// True when the weight is stored in a quantized format (its served numerics differ from the BF16 oracle).
    pub fn is_quantized(&self, base: &str) -> bool {
        self.ckpt
            .weight_scheme(base)
            .map(|s| s != "bf16" && s != "f16" && s != "f32")
            .unwrap_or(false)
    }
}

enum WeightView {
    F32(Arc<Vec<f32>>),
    Served(Arc<ServedWeight>, Profile),
}

/// One path's environment for `model::exec`.
pub struct PathEnv<'s, 'a> {
    pub kind: PathKind,
    pub shared: &'s mut Shared<'a>,
}

impl PathEnv<'_, '_> {
    fn gemm(&mut self, sub_id: &str, x: &Data, m: usize, base: &str) -> Result<(Data, usize)> {
        if let Some(g) = self.shared.backend.gpu().cloned() {
            let mut g = lock(&g)?;
            let (y, n, obs) = g.linear(&self.shared.linear_ctx(), self.kind, base, x, m)?;
            drop(g);
            self.shared.touch(base);
            self.shared.observe(sub_id.to_string(), obs);
            return Ok((y, n));
        }
        let (view, n, k) = self.shared.weight_for(self.kind, base)?;
        if x.len() != m * k {
            return Err(crate::Error::bad(
                self.shared.ckpt.location(),
                Some(base),
                format!(
                    "weight has {k} input features but the activation has {} per row",
                    x.len() / m.max(1)
                ),
            ));
        }
        let y = match &*view {
            WeightView::F32(w) => crate::device::gemm::matmul_nt(x, w, m, k, n),
            WeightView::Served(sw, profile) => {
                let (y, obs) = served::apply(sw, *profile, x, m, k, n);
                if self.shared.record_observations {
                    self.shared.observed.push((sub_id.to_string(), obs));
                }
                y
            }
        };
        Ok((y.into(), n))
    }
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
        if cached.data.device().is_none() {
            if let Some(g) = self.shared.backend.gpu() {
                // attached to the cached tensor: the op's other paths get it with their clones
                lock(g)?.input(&cached.data)?;
            }
        }
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
        let m = x.rows();
        let (y, n) = self.gemm(sub_id, &x.data, m, base)?;
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
        let k = x.cols();
        let rows = x.numel() / (groups * k).max(1);
        if let Some(g) = self.shared.backend.gpu().cloned() {
            let mut g = lock(&g)?;
            let (y, r, obs) = g.linear_grouped(
                &self.shared.linear_ctx(),
                self.kind,
                base,
                &x.data,
                rows,
                groups,
            )?;
            drop(g);
            self.shared.touch(base);
            self.shared.observe(sub_id.to_string(), obs);
            return Ok(Tensor::new(vec![rows, groups, r], y));
        }
        let (view, n, wk) = self.shared.weight_for(self.kind, base)?;
        if wk != k || n % groups != 0 {
            return Err(crate::Error::bad(
                self.shared.ckpt.location(),
                Some(base),
                format!("grouped projection: weight [{n}, {wk}] does not fit {groups} groups of {k} inputs"),
            ));
        }
        let r = n / groups;
        let shared = &mut *self.shared;
        let out = served::grouped(&x.data, rows, groups, k, r, |g, xg| {
            Ok(match &*view {
                WeightView::F32(w) => {
                    crate::device::gemm::matmul_nt(xg, &w[g * r * k..(g + 1) * r * k], rows, k, r)
                }
                WeightView::Served(sw, profile) => {
                    let sub = sw.rows(g * r, r, k);
                    let (y, obs) = served::apply(&sub, *profile, xg, rows, k, r);
                    if shared.record_observations {
                        shared.observed.push((format!("{sub_id}.g{g}"), obs));
                    }
                    y
                }
            })
        })?;
        Ok(Tensor::new(vec![rows, groups, r], out))
    }
    fn store(&self, t: &mut Tensor) {
        if self.kind == PathKind::OracleFp32 || t.data.known_bf16_exact() == Some(true) {
            return;
        }
        // values only on the device are rounded there (no trip through the host)
        if !t.data.on_host() {
            if let Some(g) = self.shared.backend.gpu() {
                if let Ok(g) = g.lock() {
                    if g.round_data(&mut t.data).is_ok() {
                        return;
                    }
                }
            }
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
        let g = self.shared.backend.gpu().cloned()?;
        let r = (|| {
            let mut g = lock(&g)?;
            if g.deferring() {
                // its observations come with the flush
                let rec = self.shared.record_observations && self.kind == PathKind::Served;
                self.shared.deferred_record.push(rec);
            }
            let (y, obs, touched, _) = g.experts(
                &self.shared.linear_ctx(),
                self.kind,
                layer,
                x,
                per,
                k,
                bases,
                limit,
                self.kind == PathKind::Served,
            )?;
            drop(g);
            for b in touched {
                self.shared.touch(&b);
            }
            for (id, o) in obs {
                self.shared.observe(id, Some(o));
            }
            Ok(y)
        })();
        Some(r)
    }
    fn chunk_rows(&self) -> Option<usize> {
        self.shared.chunk
    }
    fn device(&self) -> Box<dyn Device + '_> {
        let store = move |t: &mut Tensor| self.store(t);
        match self.shared.backend.gpu() {
            Some(gpu) => Box::new(CudaDevice::new(
                Dev {
                    gpu: gpu.clone(),
                    round: self.kind != PathKind::OracleFp32,
                },
                store,
            )),
            None => Box::new(CpuDevice::new(store)),
        }
    }
}

fn lock(
    g: &std::sync::Arc<std::sync::Mutex<crate::backend::cuda::Gpu>>,
) -> Result<std::sync::MutexGuard<'_, crate::backend::cuda::Gpu>> {
    g.lock().map_err(|_| {
        crate::Error::Backend("cuda: the device state was poisoned by an earlier failure".into())
    })
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
