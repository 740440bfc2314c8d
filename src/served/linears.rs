//! The linears of a numerics path behind one interface, [`Linears`]: a projection of stored
//! activations by a checkpoint weight as the path reads it (the FP32 oracle's decoded values, the
//! BF16 oracle's rounded ones, or the served recipe of the run's profile on the loader's reading,
//! faults and bisect's hypotheses included). The runner's environment (`probe::env`) asks it and
//! never which machine answers: [`CpuLinears`] here is the host reference; the CUDA backend's
//! implementation (`backend::linears`) runs the same recipe on the device, bit for bit.
//!
//! This is the linear half of the seam whose other half is `device::Device` (the layer's
//! non-linear ops): the linears own weights (read, cached for the op, dropped after it), which
//! the non-linear ops never touch, so they sit here above the checkpoint instead of in `device`.

use std::collections::HashMap;
use std::sync::Arc;

use super::faults::Fault;
use super::{LinearObs, Override, PathKind, Profile, ServedWeight};
use crate::checkpoint::{Checkpoint, QuantWeight};
use crate::device::gemm::matmul_nt;
use crate::tensor::Data;
use crate::{Error, Result, Tensor};

/// What a served linear needs from the run: checkpoint, profile, loader faults, hypotheses.
pub struct LinearCtx<'a> {
    pub ckpt: &'a Checkpoint,
    pub profile: Profile,
    pub fuse_pairs: bool,
    pub faults: &'a [Fault],
    pub overrides: &'a [(String, Override)],
}

/// Served observations of one call, each under its sub-id suffix (`""` for the whole linear,
/// `.g3` for group 3 of a grouped projection, the expert's sub id for the routed experts).
pub type Observed = Vec<(String, LinearObs)>;

/// The routed experts of one path run as one fused op: the output [t, d], the served
/// observations per expert linear (sub ids as the model names them), the weight bases read, and
/// per expert that received tokens the amax of the activation its w2 was fed.
pub type FusedExperts = (Tensor, Observed, Vec<String>, Vec<(usize, f32)>);

/// Where a path's linears run. Observations are returned on the served path only.
#[allow(clippy::too_many_arguments)]
pub trait Linears {
    /// y [m, n] = x [m, k] · Wᵀ of weight `base` as path `kind` reads it; returns (y, n, obs).
    fn linear(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
    ) -> Result<(Data, usize, Observed)>;
    /// A grouped projection: x [rows, G, k], weight [G·r, k], group g by rows g·r..(g+1)·r;
    /// returns ([rows, G, r] values, r, obs).
    fn linear_grouped(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        rows: usize,
        groups: usize,
    ) -> Result<(Data, usize, Observed)>;
    /// Rows `r0..r0+n` of the weight only: x [m, k] → [m, n], observed on their own (one group
    /// of a grouped projection, as bisect's replay observes it).
    fn linear_rows(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
        r0: usize,
        n: usize,
    ) -> Result<(Data, Observed)>;
    /// Pin the served reading of an NVFP4 weight to block-scale bytes in the linear layout
    /// (`None`: the stored bytes as they are, no loader layout fault) and a nibble order, its
    /// scalars resolved from `ctx` as the loader would: bisect's repairs no `Override` expresses.
    fn pin_nvfp4(
        &mut self,
        ctx: &LinearCtx,
        base: &str,
        scales: Option<&[u8]>,
        swap: bool,
    ) -> Result<()>;
    /// Undo [`Linears::pin_nvfp4`]: the next use reads the weight from its context again.
    fn unpin(&mut self, base: &str);
    /// The routed experts of a layer as one fused op, where the machine has one: x [t, d],
    /// `per[e]` = (token, routing weight) of expert e, `k` slots per token, `bases[3e..3e+3]` =
    /// (w1, w3, w2) of expert e, SwiGLU clamp `limit`; `observe`: read back the observations
    /// and the w2 amax (else both come back empty). `None`: the model runs them expert by
    /// expert through [`Linears::linear`].
    fn experts(
        &mut self,
        _ctx: &LinearCtx,
        _kind: PathKind,
        _layer: usize,
        _x: &Tensor,
        _per: &[Vec<(usize, f32)>],
        _k: usize,
        _bases: &[&str],
        _limit: f32,
        _observe: bool,
    ) -> Option<Result<FusedExperts>> {
        None
    }
    /// Op `op` is about to run on every path (its hook): a machine that reads an op's weights in
    /// one batch reads them now; a routed-experts op may be deferred, its experts run for every
    /// path at [`Linears::flush_experts`] (true: deferred).
    fn begin_op(&mut self, _ctx: &LinearCtx, _op: &crate::model::graph::Op) -> Result<bool> {
        Ok(false)
    }
    /// The op failed midway: drop what it left deferred, so the linears can run again.
    fn cancel_op(&mut self) {}
    /// Whether fused expert ops only begin now and finish at [`Linears::flush_experts`].
    fn deferring(&self) -> bool {
        false
    }
    /// Finish the deferred expert ops; each one's observations, in the order they began.
    fn flush_experts(&mut self, _ctx: &LinearCtx) -> Result<Vec<Observed>> {
        Ok(Vec::new())
    }
    /// Drop the weights read for the op that just ended.
    fn clear(&mut self);
}

/// One weight as the host reference holds it for an op: the decoded values, and the BF16 and
/// served readings made from them when a path first asks.
struct Cached {
    qw: QuantWeight,
    f32: Arc<Vec<f32>>,
    bf16: Option<Arc<Vec<f32>>>,
    /// The served reading and the hypotheses it was made under (bisect's replay changes them
    /// between evaluations and keeps the decoded weight).
    served: Option<(Vec<Override>, Arc<ServedWeight>)>,
}

/// A weight as one path reads it on the host.
enum Operand {
    /// Plain values (the oracles): an f32 GEMM with f64 accumulation.
    Dense(Arc<Vec<f32>>),
    /// The loader's reading under the profile's recipe.
    Served(Arc<ServedWeight>, Profile),
}

/// The host reference of the linears: weights decoded when an op first needs them and kept for
/// the op, every path's reading made once from the decoded values.
pub struct CpuLinears {
    cache: HashMap<String, Cached>,
    /// Served readings pinned by [`Linears::pin_nvfp4`], kept until unpinned.
    pinned: HashMap<String, Arc<ServedWeight>>,
    /// Approximate bytes held by `cache`; past `budget` the cache is emptied before the next
    /// read, so an op over hundreds of experts stays bounded (each path re-reads what it needs).
    bytes: usize,
    budget: usize,
}

impl Default for CpuLinears {
    fn default() -> Self {
        CpuLinears {
            cache: HashMap::new(),
            pinned: HashMap::new(),
            bytes: 0,
            budget: 4 << 30,
        }
    }
}

impl CpuLinears {
    fn load(&mut self, ckpt: &Checkpoint, base: &str) -> Result<&mut Cached> {
        if !self.cache.contains_key(base) {
            let qw = ckpt.weight(base)?;
            let f32 = Arc::new(qw.dequantize()?.data.into_vec());
            // f32 dequant + BF16 or served copy + the stored bytes, roughly
            let size = f32.len() * 4 * 3;
            if self.bytes + size > self.budget && !self.cache.is_empty() {
                self.clear();
            }
            self.bytes += size;
            self.cache.insert(
                base.to_string(),
                Cached {
                    qw,
                    f32,
                    bf16: None,
                    served: None,
                },
            );
        }
        Ok(self.cache.get_mut(base).expect("inserted above"))
    }

    /// The operand of `base` on path `kind`, with its shape (n, k).
    fn operand(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
    ) -> Result<(Operand, usize, usize)> {
        let faults: Vec<&Fault> = super::faults::hitting(ctx.faults, base);
        let overrides = super::overrides_of(ctx.overrides, base);
        let pinned = self.pinned.get(base).cloned();
        let c = self.load(ctx.ckpt, base)?;
        let (n, k) = (c.qw.out_features, c.qw.in_features);
        let op = match kind {
            PathKind::OracleFp32 => Operand::Dense(c.f32.clone()),
            PathKind::OracleBf16 => Operand::Dense(
                c.bf16
                    .get_or_insert_with(|| {
                        Arc::new(
                            c.f32
                                .iter()
                                .map(|&v| crate::numerics::bf16::round(v))
                                .collect(),
                        )
                    })
                    .clone(),
            ),
            PathKind::Served => {
                let sw = match (pinned, &c.served) {
                    (Some(sw), _) => sw,
                    (None, Some((ovs, sw))) if *ovs == overrides => sw.clone(),
                    (None, _) => {
                        let sw = Arc::new(super::prepare(
                            ctx.ckpt,
                            &c.qw,
                            &c.f32,
                            ctx.fuse_pairs,
                            &faults,
                            &overrides,
                        )?);
                        c.served = Some((overrides, sw.clone()));
                        sw
                    }
                };
                Operand::Served(sw, ctx.profile)
            }
        };
        Ok((op, n, k))
    }
}

impl Operand {
    /// x [m, k] by the operand's rows `r0..r0+n` (`r0` None: the whole weight, n rows).
    fn apply(
        &self,
        x: &[f32],
        m: usize,
        k: usize,
        r0: Option<usize>,
        n: usize,
    ) -> (Vec<f32>, Option<LinearObs>) {
        match self {
            Operand::Dense(w) => {
                let r0 = r0.unwrap_or(0);
                (matmul_nt(x, &w[r0 * k..(r0 + n) * k], m, k, n), None)
            }
            Operand::Served(sw, profile) => {
                let (y, obs) = match r0 {
                    None => super::apply(sw, *profile, x, m, k, n),
                    Some(r0) => super::apply(&sw.rows(r0, n, k), *profile, x, m, k, n),
                };
                (y, Some(obs))
            }
        }
    }
}

impl Linears for CpuLinears {
    fn linear(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
    ) -> Result<(Data, usize, Observed)> {
        let (op, n, k) = self.operand(ctx, kind, base)?;
        if x.len() != m * k {
            return Err(Error::bad(
                ctx.ckpt.location(),
                Some(base),
                format!(
                    "weight has {k} input features but the activation has {} per row",
                    x.len() / m.max(1)
                ),
            ));
        }
        let (y, obs) = op.apply(x, m, k, None, n);
        let obs = obs.map(|o| (String::new(), o)).into_iter().collect();
        Ok((y.into(), n, obs))
    }

    fn linear_grouped(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        rows: usize,
        groups: usize,
    ) -> Result<(Data, usize, Observed)> {
        let (op, n, k) = self.operand(ctx, kind, base)?;
        if groups == 0 || n % groups != 0 || x.len() != rows * groups * k {
            return Err(Error::bad(
                ctx.ckpt.location(),
                Some(base),
                format!(
                    "grouped projection: weight [{n}, {k}] does not fit {groups} groups of {} inputs",
                    x.len() / (rows * groups).max(1)
                ),
            ));
        }
        let r = n / groups;
        let mut obs = Observed::new();
        let y = super::grouped(x, rows, groups, k, r, |g, xg| {
            let (y, o) = op.apply(xg, rows, k, Some(g * r), r);
            obs.extend(o.map(|o| (format!(".g{g}"), o)));
            Ok(y)
        })?;
        Ok((y.into(), r, obs))
    }

    fn linear_rows(
        &mut self,
        ctx: &LinearCtx,
        kind: PathKind,
        base: &str,
        x: &Data,
        m: usize,
        r0: usize,
        n: usize,
    ) -> Result<(Data, Observed)> {
        let (op, n_all, k) = self.operand(ctx, kind, base)?;
        if x.len() != m * k || r0 + n > n_all {
            return Err(Error::bad(
                ctx.ckpt.location(),
                Some(base),
                format!(
                    "rows {r0}..{} of a weight [{n_all}, {k}] for an activation of {} per row",
                    r0 + n,
                    x.len() / m.max(1)
                ),
            ));
        }
        let (y, obs) = op.apply(x, m, k, Some(r0), n);
        let obs = obs.map(|o| (String::new(), o)).into_iter().collect();
        Ok((y.into(), obs))
    }

    fn pin_nvfp4(
        &mut self,
        ctx: &LinearCtx,
        base: &str,
        scales: Option<&[u8]>,
        swap: bool,
    ) -> Result<()> {
        let sw = pinned_nvfp4(ctx, base, scales, swap)?;
        self.pinned.insert(base.to_string(), Arc::new(sw));
        Ok(())
    }

    fn unpin(&mut self, base: &str) {
        self.pinned.remove(base);
    }

    fn clear(&mut self) {
        self.cache.clear();
        self.pinned.clear();
        self.bytes = 0;
    }
}

/// The served reading of an NVFP4 weight pinned to block-scale bytes (see
/// [`Linears::pin_nvfp4`]): `e2m1 · e4m3(scale byte)` from the stored codes, the nibble order
/// given, the loader's scalars with the hypotheses of `ctx` — what the device decodes.
pub fn pinned_nvfp4(
    ctx: &LinearCtx,
    base: &str,
    scales: Option<&[u8]>,
    swap: bool,
) -> Result<ServedWeight> {
    use crate::numerics::{e2m1, e4m3, nvfp4};
    let ckpt = ctx.ckpt;
    let lay = ckpt.weight_layout(base)?;
    let m = &lay.meta;
    let conv = nvfp4_convention(m).ok_or_else(|| {
        Error::usage(format!(
            "internal: {base} is not an NVFP4 weight (block scales pinned)"
        ))
    })?;
    let faults = super::faults::hitting(ctx.faults, base);
    let ovs = super::overrides_of(ctx.overrides, base);
    let p = super::nvfp4_params_of(ckpt, m, conv, ctx.fuse_pairs, &faults, &ovs);
    let sc: std::borrow::Cow<'_, [u8]> = match scales {
        Some(s) => s.into(),
        None => {
            let name = lay.scale.as_deref().ok_or_else(|| {
                Error::bad(
                    &m.file,
                    Some(base),
                    "NVFP4 weight without a block-scale tensor",
                )
            })?;
            ckpt.canonical_bytes(name)?
        }
    };
    let packed = ckpt.canonical_bytes(&lay.weight)?;
    let (rows, cols) = (m.out_features, m.in_features);
    let nb = cols / nvfp4::BLOCK;
    if sc.len() < rows * nb || packed.len() < rows * cols / 2 {
        return Err(Error::bad(
            &m.file,
            Some(base),
            "NVFP4 bytes shorter than the weight's shape",
        ));
    }
    let wq = (0..rows * cols)
        .map(|i| {
            let (mut lo, mut hi) = e2m1::unpack(packed[i / 2]);
            if swap {
                std::mem::swap(&mut lo, &mut hi);
            }
            let code = if i % 2 == 0 { lo } else { hi };
            e2m1::decode(code) * e4m3::decode(sc[(i / cols) * nb + (i % cols) / nvfp4::BLOCK])
        })
        .collect();
    Ok(ServedWeight::Nvfp4 {
        wq: Arc::new(wq),
        p,
    })
}

/// The NVFP4 convention of a weight when it is read as NVFP4 (what `Checkpoint::weight` would
/// decode as `WeightFormat::Nvfp4`), from its metadata alone.
pub fn nvfp4_convention(
    m: &crate::checkpoint::WeightMeta,
) -> Option<crate::numerics::nvfp4::Convention> {
    use crate::checkpoint::Scheme;
    matches!(
        m.scheme,
        Scheme::Mxfp4 | Scheme::Nvfp4Ct | Scheme::Nvfp4ModelOpt
    )
    .then_some(m.convention)
    .flatten()
}
