//! The numerics paths as `OpEnv`s over one checkpoint: the runner's three paths, and bisect's
//! replay of one op under a hypothesis (`probe::replay`), which is the served path with a
//! [`ReplayTrace`] set on [`Shared::replay`]. Weights are read from the checkpoint when an op
//! first needs them and dropped when the op is done ([`Shared::clear`]), so memory is bounded by
//! one op's weights plus the activations still to be consumed.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use crate::backend::Backend;
use crate::checkpoint::{Checkpoint, WeightFormat};
use crate::device::ops::RopeTable;
use crate::device::Device;
use crate::model::exec::OpEnv;
use crate::model::ModelConfig;
use crate::numerics::nvfp4::QuantHealth;
use crate::served::faults::Fault;
use crate::served::{LinearCtx, LinearObs, Linears, Observed, Override, PathKind, Profile};
use crate::tensor::Data;
use crate::{Result, Tensor};

/// RoPE tables [`Shared`] keeps (one per frequency set and position range in use).
const ROPE_TABLES: usize = 4;

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
    /// The token chunk the current op runs over, in a run in chunks (`probe::chunked`;
    /// `OpEnv::chunk_at`); `tokens` are then the chunk's.
    pub at: Option<crate::model::env::ChunkAt>,
    /// What ops keep for their next token chunk (`OpEnv::put_carry`), per execution slot
    /// ([`Shared::carry_slot`]) and key.
    pub carry: HashMap<(usize, String), Tensor>,
    /// Which execution of the op runs now (0–2 the propagated paths, 3 the isolated served
    /// one, 4 the FP32 numerics on the BF16 oracle's inputs): each keeps its own carry.
    pub carry_slot: usize,
    /// Keep the linears' weights from op to op until [`Shared::release_weights`] (a run in
    /// chunks on a device: a layer's weights are read once for all its chunks).
    pub hold_weights: bool,
    /// Parameters (norm weights, mixing tables, tid2eid, ...) read during the current op: every
    /// path of the op reads the same values, so they come from the checkpoint once per op.
    params: HashMap<String, Tensor>,
    /// The RoPE tables made so far (frequencies' bits, positions): every path's RoPE ops of a
    /// layer, and the layers sharing its frequencies, use one (the newest [`ROPE_TABLES`] kept).
    ropes: Vec<(Vec<u32>, std::ops::Range<usize>, Arc<RopeTable>)>,
    /// Set while bisect replays an op under a hypothesis: the served path then runs per weight
    /// and records for the hypothesis instead of for the run (see [`ReplayTrace`]).
    pub replay: Option<ReplayTrace>,
    /// `--served-chunk`: the served path prefills as an engine does, in chunks
    /// (`probe::prefill`).
    pub prefill: Option<crate::served::engine::Prefill>,
    /// The current op's oracle products on BF16-stored weights ([`OracleProducts`]).
    products: OracleProducts,
}

/// Within one op's executions, the oracle linears on BF16-stored weights fed one of the op's
/// inputs: both oracles multiply the same values there (a BF16 weight rounds to itself, and
/// each oracle's GEMM sums in f64 and rounds once to f32), so an oracle execution fed the same
/// activation takes the product an earlier one made instead of computing it again. The noise
/// execution (FP32 numerics on the BF16 oracle's inputs, `runner::execs`) repeats the BF16
/// oracle's LM head, `wo_a`, router and the compressors' and indexer's first projections this
/// way. Only the op's own inputs are keys: they stay alive for the whole op, so an identity
/// ([`Data::identity`]) cannot be reused by other values.
#[derive(Default)]
struct OracleProducts {
    /// The identities of the op's inputs (empty: nothing is kept).
    inputs: Vec<(bool, usize)>,
    /// (weight base, groups, rows of x, the input's identity) → (product, output columns).
    kept: Vec<(ProductKey, Data, usize)>,
}

type ProductKey = (String, usize, usize, (bool, usize));

/// What differs when the environment evaluates bisect's replay of one op (`probe::replay`)
/// instead of a runner path, and what that evaluation records:
/// - the path is chosen per weight: the BF16 oracle's numerics for an `oracle`-patched or
///   unquantized weight (a BF16 GEMM), the served numerics for the rest;
/// - every served linear's observation is kept with its weight base (`obs`), and the amax of the
///   activation each base was fed (`act_amax`, the oracle's when the base runs in its numerics);
/// - a grouped projection runs group by group ([`Linears::linear_rows`]), each group observed on
///   its own as `{sub_id}.g{g}`; the routed experts run fused only when every used expert's
///   weights share one path (else expert by expert); stores round on the host.
///
/// These are the numbers bisect has always ranked its hypotheses by, kept as they were.
#[derive(Clone, Debug, Default)]
pub struct ReplayTrace {
    /// Weights evaluated in the BF16 oracle's numerics.
    pub oracle: HashSet<String>,
    /// (sub id, weight base, observation) of every served linear, in call order.
    pub obs: Vec<(String, String, LinearObs)>,
    /// Per weight base, the amax of the activation it was fed (max over calls).
    pub act_amax: HashMap<String, f32>,
}

impl ReplayTrace {
    /// A trace for one evaluation with `oracle` in the BF16 oracle's numerics.
    pub fn new(oracle: HashSet<String>) -> Self {
        ReplayTrace {
            oracle,
            ..Default::default()
        }
    }

    fn note_amax(&mut self, base: &str, a: f32) {
        let e = self.act_amax.entry(base.to_string()).or_insert(0.0);
        *e = e.max(a);
    }

    /// Keep a served linear's observation (the first of the call's) under its sub id and base.
    fn observe(&mut self, kind: PathKind, sub_id: String, base: &str, obs: Observed) {
        if kind == PathKind::Served {
            let o = obs.into_iter().next().map(|(_, o)| o).unwrap_or_default();
            self.obs.push((sub_id, base.to_string(), o));
        }
    }

    /// The notes of a fused routed-experts call: w1/w3 are fed each used expert's token rows of
    /// `x`, w2 the amaxes the call read back; observations come per used expert as (w1, w3, w2).
    fn note_experts(
        &mut self,
        kind: PathKind,
        x: &Tensor,
        per: &[Vec<(usize, f32)>],
        bases: &[&str],
        obs: Observed,
        w2_amax: Vec<(usize, f32)>,
    ) {
        let used = used_experts(per);
        let d = x.cols();
        for &e in &used {
            let a = per[e].iter().fold(0f32, |a, &(ti, _)| {
                a.max(amax(&x.data[ti * d..(ti + 1) * d]))
            });
            self.note_amax(bases[3 * e], a);
            self.note_amax(bases[3 * e + 1], a);
        }
        for (e, a) in w2_amax {
            self.note_amax(bases[3 * e + 2], a);
        }
        if kind == PathKind::Served {
            for (i, (id, o)) in obs.into_iter().enumerate() {
                let e = used[i / 3];
                self.obs.push((id, bases[3 * e + i % 3].to_string(), o));
            }
        }
    }
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |a, v| a.max(v.abs()))
}

/// The experts that received tokens.
fn used_experts(per: &[Vec<(usize, f32)>]) -> Vec<usize> {
    (0..per.len()).filter(|&e| !per[e].is_empty()).collect()
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
            ropes: Vec::new(),
            record_observations: false,
            deferred_record: Vec::new(),
            backend: Backend::Cpu,
            chunk: None,
            at: None,
            carry: HashMap::new(),
            carry_slot: 0,
            hold_weights: false,
            replay: None,
            prefill: None,
            products: OracleProducts::default(),
        }
    }

    /// Keep the oracle products of the op about to run on `inputs` ([`OracleProducts`]) until
    /// [`Shared::drop_products`] or [`Shared::clear`].
    pub fn keep_products(&mut self, inputs: &[&Tensor]) {
        self.products = OracleProducts {
            inputs: inputs.iter().filter_map(|t| t.data.identity()).collect(),
            kept: Vec::new(),
        };
    }

    /// Forget the op's kept oracle products.
    pub fn drop_products(&mut self) {
        self.products = OracleProducts::default();
    }

    /// The key of an oracle linear whose product may be kept or taken: `kind` an oracle, not a
    /// replay, `base` stored in BF16, `x` one of the op's inputs.
    fn product_key(
        &self,
        kind: PathKind,
        base: &str,
        x: &Data,
        rows: usize,
        groups: usize,
    ) -> Option<ProductKey> {
        if kind == PathKind::Served || self.replay.is_some() || self.products.inputs.is_empty() {
            return None;
        }
        let id = x
            .identity()
            .filter(|id| self.products.inputs.contains(id))?;
        (self.ckpt.weight_scheme(base) == Some("bf16"))
            .then(|| (base.to_string(), groups, rows, id))
    }

    fn kept_product(&self, key: &Option<ProductKey>) -> Option<(Data, usize)> {
        let key = key.as_ref()?;
        self.products
            .kept
            .iter()
            .find(|(k, _, _)| k == key)
            .map(|(_, y, n)| (y.clone(), *n))
    }

    fn keep_product(&mut self, key: Option<ProductKey>, y: &Data, n: usize) {
        if let Some(k) = key {
            self.products.kept.push((k, y.clone(), n));
        }
    }

    /// Run the paths on `backend` (the CPU until set).
    pub fn set_backend(&mut self, backend: Backend) {
        self.linears = backend.linears();
        self.backend = backend;
    }

    /// Where the paths run.
    pub fn backend(&self) -> &Backend {
        &self.backend
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

    /// Pin the served reading of an NVFP4 weight to block-scale bytes and a nibble order under
    /// the current overrides (bisect's repairs no `Override` expresses; [`Linears::pin_nvfp4`]).
    pub fn pin_nvfp4(&mut self, base: &str, scales: Option<&[u8]>, swap: bool) -> Result<()> {
        self.with_linears(|l, ctx| l.pin_nvfp4(ctx, base, scales, swap))
    }

    /// Undo [`Shared::pin_nvfp4`].
    pub fn unpin(&mut self, base: &str) {
        self.linears.unpin(base);
    }

    /// Drop every cached weight (called between ops; the linears' weights stay while
    /// [`Shared::hold_weights`]).
    pub fn clear(&mut self) {
        if !self.hold_weights {
            self.linears.clear();
        }
        self.params.clear();
        self.drop_products();
        self.observed.clear();
        self.touched.clear();
        self.touched_set.clear();
    }

    /// Drop the linears' weights held over ops ([`Shared::hold_weights`]).
    pub fn release_weights(&mut self) {
        self.linears.clear();
    }

    /// True when the weight is stored in a quantized format (its served numerics differ from the BF16 oracle).
    pub fn is_quantized(&self, base: &str) -> bool {
        self.ckpt
            .weight_scheme(base)
            .map(|s| s != "bf16" && s != "f16" && s != "f32")
            .unwrap_or(false)
    }
}

/// One path's environment for `model::exec` (bisect's replay: the served path with
/// [`Shared::replay`] set).
pub struct PathEnv<'s, 'a> {
    pub kind: PathKind,
    pub shared: &'s mut Shared<'a>,
}

impl PathEnv<'_, '_> {
    /// The path weight `base` is read in: the env's own, except in a replay, where an
    /// oracle-patched or unquantized weight runs in the BF16 oracle's numerics.
    fn kind_of(&self, base: &str) -> PathKind {
        match &self.shared.replay {
            Some(tr) if tr.oracle.contains(base) || !self.shared.is_quantized(base) => {
                PathKind::OracleBf16
            }
            _ => self.kind,
        }
    }

    /// The replay's grouped projection: group by group through [`Linears::linear_rows`], each
    /// group's activation amax noted and its observation kept as `{sub_id}.g{g}`.
    fn replay_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor> {
        let k = x.cols();
        let rows = x.numel() / (groups * k).max(1);
        let n = self.shared.ckpt.weight_meta(base)?.out_features;
        if groups == 0 || n % groups != 0 {
            return Err(crate::Error::bad(
                self.shared.ckpt.location(),
                Some(base),
                format!("grouped projection: {n} outputs do not split into {groups} groups"),
            ));
        }
        let r = n / groups;
        let kind = self.kind_of(base);
        let sh = &mut *self.shared;
        sh.touch(base);
        let out = crate::served::grouped(&x.data, rows, groups, k, r, |g, xg| {
            let xd = crate::tensor::Data::from(xg.to_vec());
            let (y, o) =
                sh.with_linears(|l, c| l.linear_rows(c, kind, base, &xd, rows, g * r, r))?;
            if let Some(tr) = &mut sh.replay {
                tr.note_amax(base, amax(xg));
                tr.observe(kind, format!("{sub_id}.g{g}"), base, o);
            }
            Ok(y.into_vec())
        })?;
        Ok(Tensor::new(vec![rows, groups, r], out))
    }

    /// Whether the replay runs the routed experts fused, and in which path: only when some
    /// expert received tokens and every used expert's weights share one path (one fused call
    /// computes every expert in one numerics).
    fn replay_experts_kind(&self, per: &[Vec<(usize, f32)>], bases: &[&str]) -> Option<PathKind> {
        let used = used_experts(per);
        if used.is_empty() || bases.len() < 3 * per.len() {
            return None;
        }
        let mut kinds = used
            .iter()
            .flat_map(|&e| (0..3).map(move |j| bases[3 * e + j]))
            .map(|b| self.kind_of(b));
        let kind = kinds.next()?;
        kinds.all(|k| k == kind).then_some(kind)
    }
}

impl OpEnv for PathEnv<'_, '_> {
    fn cfg(&self) -> &ModelConfig {
        &self.shared.cfg
    }
    fn swiglu_limit(&self, weight: &str) -> f32 {
        crate::served::faults::swiglu_limit(
            self.shared.cfg.swiglu_limit as f32,
            self.kind == PathKind::Served,
            &self.shared.faults,
            &self.shared.overrides,
            weight,
        )
    }
    fn weight_file(&self, name: &str) -> Option<std::path::PathBuf> {
        Some(self.shared.ckpt.file_of(name))
    }
    fn token_ids(&self) -> &[u32] {
        &self.shared.tokens
    }
    fn param(&mut self, canonical: &str) -> Result<Tensor> {
        let t = match self.shared.params.get(canonical) {
            Some(t) => t.clone(),
            None => {
                let _s = crate::profile::span("host: param read");
                let t = self.shared.ckpt.tensor_f32(canonical)?;
                self.shared.params.insert(canonical.to_string(), t.clone());
                t
            }
        };
        if self.kind == PathKind::Served {
            // the layer faults of docs/CATALOGUE-2026.md: the served path's reading only
            if let Some(u) =
                crate::served::faults::param_reading(&self.shared.faults, canonical, &t)
            {
                return Ok(u);
            }
        }
        Ok(t)
    }
    fn routed_weight_factor(&self, layer: usize) -> f32 {
        crate::served::faults::routed_weight_factor(
            self.shared.cfg.routed_scaling_factor as f32,
            self.kind == PathKind::Served,
            &self.shared.faults,
            layer,
        )
    }
    fn param_dev(&mut self, canonical: &str) -> Result<Tensor> {
        let t = self.param(canonical)?;
        if self.kind == PathKind::Served
            && crate::served::faults::param_reading(&self.shared.faults, canonical, &t).is_some()
        {
            return Ok(t);
        }
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
    fn rope_table(&mut self, freqs: &[f32], positions: std::ops::Range<usize>) -> Arc<RopeTable> {
        let bits: Vec<u32> = freqs.iter().map(|f| f.to_bits()).collect();
        let ropes = &mut self.shared.ropes;
        if let Some((_, _, t)) = ropes.iter().find(|(b, p, _)| *b == bits && *p == positions) {
            return t.clone();
        }
        let t = Arc::new(RopeTable::new(freqs, positions.clone()));
        if ropes.len() == ROPE_TABLES {
            ropes.remove(0);
        }
        ropes.push((bits, positions, t.clone()));
        t
    }
    fn embed_rows(&mut self, ids: &[u32]) -> Result<Tensor> {
        // every path of the op reads the run's rows: read once per op (the cache is cleared
        // between ops) and, on a device, uploaded once; the other paths share that copy (at 4,096
        // V4-Flash tokens each path's own read, decode and upload took ~55 ms of host time)
        const KEY: &str = "embed.weight rows";
        if ids != self.shared.tokens.as_slice() {
            return self.shared.ckpt.embedding_rows(ids);
        }
        if let Some(t) = self.shared.params.get(KEY) {
            return Ok(t.clone());
        }
        let t = {
            let _s = crate::profile::span("host: param read");
            self.shared.ckpt.embedding_rows(ids)?
        };
        self.shared.backend.make_resident(&t.data)?;
        let t = match t.data.device() {
            // the device copy alone: clones share it instead of copying the host values
            Some(d) => Tensor::new(t.shape.clone(), Data::from_device(d.clone())),
            None => t,
        };
        self.shared.params.insert(KEY.to_string(), t.clone());
        Ok(t)
    }
    fn linear(&mut self, sub_id: &str, x: &Tensor, base: &str) -> Result<Tensor> {
        let (kind, m) = (self.kind_of(base), x.rows());
        let key = self.shared.product_key(kind, base, &x.data, m, 1);
        if let Some((y, n)) = self.shared.kept_product(&key) {
            self.shared.touch(base);
            return Ok(x.with_last_dim(n, y));
        }
        let (y, n, obs) = self
            .shared
            .with_linears(|l, ctx| l.linear(ctx, kind, base, &x.data, m))?;
        self.shared.keep_product(key, &y, n);
        self.shared.touch(base);
        match &mut self.shared.replay {
            Some(tr) => {
                tr.note_amax(base, amax(&x.data));
                tr.observe(kind, sub_id.to_string(), base, obs);
            }
            None => self.shared.observe(sub_id, obs),
        }
        Ok(x.with_last_dim(n, y))
    }
    fn linear_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor> {
        if self.shared.replay.is_some() {
            return self.replay_grouped(sub_id, x, base, groups);
        }
        // x [rows, G, K]; weight [G·R, K]: group g uses rows g·R..(g+1)·R
        let rows = x.numel() / (groups * x.cols()).max(1);
        let kind = self.kind;
        let key = self.shared.product_key(kind, base, &x.data, rows, groups);
        if let Some((y, r)) = self.shared.kept_product(&key) {
            self.shared.touch(base);
            return Ok(Tensor::new(vec![rows, groups, r], y));
        }
        let (y, r, obs) = self
            .shared
            .with_linears(|l, ctx| l.linear_grouped(ctx, kind, base, &x.data, rows, groups))?;
        self.shared.keep_product(key, &y, r);
        self.shared.touch(base);
        self.shared.observe(sub_id, obs);
        Ok(Tensor::new(vec![rows, groups, r], y))
    }
    fn store(&self, t: &mut Tensor) {
        if self.shared.replay.is_some() {
            // the replay has always rounded its stores on the host
            t.round_bf16();
            return;
        }
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
        let replay = self.shared.replay.is_some();
        let kind = match replay {
            true => self.replay_experts_kind(per, bases)?,
            false => self.kind,
        };
        let sh = &mut *self.shared;
        if sh.linears.deferring() {
            // its observations come with the flush
            let rec = sh.record_observations && kind == PathKind::Served;
            sh.deferred_record.push(rec);
        }
        // the replay reads back the w2 amaxes on either path
        let observe = replay || kind == PathKind::Served;
        let r = sh
            .with_linears(|l, ctx| l.experts(ctx, kind, layer, x, per, k, bases, limit, observe))?;
        Some(r.map(|(y, obs, touched, w2_amax)| {
            for b in touched {
                sh.touch(&b);
            }
            match &mut sh.replay {
                Some(tr) => tr.note_experts(kind, x, per, bases, obs, w2_amax),
                None if sh.record_observations => sh.observed.extend(obs),
                None => {}
            }
            y
        }))
    }
    fn chunk_rows(&self) -> Option<usize> {
        self.shared.chunk
    }
    fn chunk_at(&self) -> Option<crate::model::env::ChunkAt> {
        self.shared.at
    }
    fn take_carry(&mut self, key: &str) -> Option<Tensor> {
        let slot = self.shared.carry_slot;
        self.shared.carry.remove(&(slot, key.to_string()))
    }
    fn put_carry(&mut self, key: &str, t: Tensor) {
        let slot = self.shared.carry_slot;
        self.shared.carry.insert((slot, key.to_string()), t);
    }
    fn cached_before(&self) -> Option<usize> {
        let p = self.shared.prefill.as_ref()?;
        let at = self.shared.at?;
        (self.kind == PathKind::Served).then(|| p.chunk_start(at.start))
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

#[cfg(test)]
mod product_tests {
    use super::*;
    use crate::model::exec::OpEnv;

    /// An activation of BF16 values, not zeros (a small LCG).
    fn activation(rows: usize, cols: usize, seed: u32) -> Tensor {
        let mut s = seed;
        let v: Vec<f32> = (0..rows * cols)
            .map(|_| {
                s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
                crate::numerics::bf16::round((s >> 8) as f32 / (1u32 << 24) as f32 * 4.0 - 2.0)
            })
            .collect();
        Tensor::new(vec![rows, cols], v)
    }

    /// x · Wᵀ summed in f64 and rounded once: the oracles' GEMM, written out.
    fn reference(x: &Tensor, w: &Tensor) -> Vec<f32> {
        let (m, k, n) = (x.rows(), x.cols(), w.rows());
        let mut y = vec![0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let s: f64 = (0..k)
                    .map(|c| x.data[i * k + c] as f64 * w.data[j * k + c] as f64)
                    .sum();
                y[i * n + j] = s as f32;
            }
        }
        y
    }

    #[test]
    fn an_oracle_takes_the_other_oracles_product_on_a_bf16_weight_fed_the_ops_input() {
        let ck = crate::synth::builtin(0).expect("built-in model");
        let cfg = ck.model_config().expect("config").clone();
        assert_eq!(ck.weight_scheme("head"), Some("bf16"));
        let x = activation(3, cfg.hidden_size, 7);
        let w = ck.tensor_f32("head.weight").expect("head");
        let want = reference(&x, &w);
        let mut sh = Shared::new(&ck, cfg, vec![1, 2, 3], Profile::BlackwellW4a4);
        sh.keep_products(&[&x]);
        let run = |sh: &mut Shared, kind: PathKind, x: &Tensor| {
            let mut env = PathEnv { kind, shared: sh };
            env.linear("head", x, "head").expect("linear")
        };
        let bf = run(&mut sh, PathKind::OracleBf16, &x);
        assert_eq!(&bf.data[..], &want[..], "the BF16 oracle's product");
        assert_eq!(sh.products.kept.len(), 1, "kept for the op");
        // the FP32 execution on the same input takes the kept product: poison it to see
        sh.products.kept[0].1 = Data::from(vec![f32::NAN; want.len()]);
        let fp = run(&mut sh, PathKind::OracleFp32, &x);
        assert!(
            fp.data.iter().all(|v| v.is_nan()),
            "the kept product was taken"
        );
        assert_eq!(fp.shape, bf.shape);
        // other values (a copy is not the op's input), the served path, a quantized weight,
        // and the next op compute their own
        let copy = Tensor::new(x.shape.clone(), x.data.to_vec());
        let fp = run(&mut sh, PathKind::OracleFp32, &copy);
        assert_eq!(&fp.data[..], &want[..]);
        let sv = run(&mut sh, PathKind::Served, &x);
        assert!(sv.data.iter().all(|v| v.is_finite()));
        let q = "layers.0.attn.wq_a";
        assert_ne!(sh.ckpt.weight_scheme(q), Some("bf16"));
        let mut env = PathEnv {
            kind: PathKind::OracleBf16,
            shared: &mut sh,
        };
        env.linear("q_a", &x, q).expect("linear");
        assert_eq!(sh.products.kept.len(), 1, "{q} is quantized: nothing kept");
        sh.clear();
        let fp = run(&mut sh, PathKind::OracleFp32, &x);
        assert_eq!(&fp.data[..], &want[..]);
        assert!(sh.products.kept.is_empty());
    }
}
