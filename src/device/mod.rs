//! The op math the layer graph needs, behind one interface: a [`Device`] carries every
//! non-linear op of the layer (norms, RoPE, mHC pre/post/head, attention, the compressor's
//! tail, the indexer's scores, routing, SwiGLU, sums; the model families' grouped-query
//! attention, MLA key gather, half-split RoPE and gpt-oss GLU) with the path's storage
//! rounding, so `model::exec` and `model::family` state each op once and never ask where it runs.
//!
//! Two implementations: [`cpu::CpuDevice`] (the host reference: [`kern`], [`ops`], [`gemm`],
//! [`family`]) and `backend::layer::CudaDevice` (`kernels/layer.cu`), which agree bit for bit:
//! every reduction sums exact f32 products in f64 and rounds once, every exponential is
//! evaluated in f64.
//! The linears are not here: a path's `OpEnv` owns its weights and their served reading
//! (`served`), and the backends run them.

pub mod cpu;
pub mod family;
pub mod gemm;
pub mod kern;
pub mod ops;

pub use cpu::CpuDevice;

use crate::{Result, Tensor};
use family::{GqaDims, MlaDims};
use kern::{AttnDims, HcParams, IndexerDims, Routing};
use ops::RopeTable;

/// The compressed rows of an attention op as a [`Device`] takes them: the layer's ratio (each
/// query's causal count, `kern::CmpKeys::causal`) and the indexer's selection [t, kk] as the op
/// received it (entries −1 or a row index; any order, repeats allowed): each device checks it
/// (`kern::selection_error`) and makes the per-query lists (`kern::selection_lists`) itself, so
/// a selection left on the device by the indexer is read there.
#[derive(Clone, Copy, Debug)]
pub struct CmpRows<'a> {
    pub ratio: usize,
    pub sel: Option<&'a Tensor>,
}

/// The layer's non-linear ops on one numerics path. Every method returns its output rounded the
/// way the path stores activations (BF16 on the BF16 and served paths, none on the FP32 oracle),
/// at the points where the spec rounds (docs/DSV4-LAYER.md §3).
#[allow(clippy::too_many_arguments)]
pub trait Device {
    /// Each row of x [t, d] repeated `hc` times: [t, hc, d] (no rounding: a copy).
    fn repeat_rows(&self, x: &Tensor, d: usize, hc: usize) -> Result<Tensor>;
    /// RMSNorm of each row of x [.., cols] with weight `w`.
    fn rmsnorm(&self, x: &Tensor, w: &[f32], eps: f32) -> Result<Tensor>;
    /// RoPE of dims [nope, dh) of each head of width dh of each row of x [t, k·dh] (k ≥ 1
    /// heads) at position = row.
    fn rope(&self, x: &Tensor, dh: usize, nope: usize, tab: &RopeTable) -> Result<Tensor>;
    /// Per-head RMSNorm without weight, then RoPE on dims [nope, dh) of each head; q [t, h·dh].
    fn q_rope(
        &self,
        q: &Tensor,
        h: usize,
        dh: usize,
        nope: usize,
        tab: &RopeTable,
        eps: f32,
    ) -> Result<Tensor>;
    /// mHC pre over the residual x [t, hc, d] with the mixing table f: (y [t, d] rounded,
    /// post [t, hc], comb [t, hc, hc]).
    fn hc_pre(
        &self,
        x: &Tensor,
        t: usize,
        d: usize,
        f: &Tensor,
        p: &HcParams,
        rms_eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)>;
    /// mHC post: out [t, hc, d] = post · y + combᵀ · x.
    fn hc_post(
        &self,
        y: &Tensor,
        x: &Tensor,
        post: &Tensor,
        comb: &Tensor,
        t: usize,
        hc: usize,
        d: usize,
    ) -> Result<Tensor>;
    /// mHC head: the mixing rows [t, hc] (scaled by ρ), `coef` of them the stream weights, then
    /// the weighted sum of x [t, hc, d] → [t, d].
    fn hc_head(
        &self,
        x: &Tensor,
        t: usize,
        d: usize,
        hc: usize,
        f: &Tensor,
        rms_eps: f32,
        coef: &dyn Fn(&[f32]) -> Vec<f32>,
    ) -> Result<Tensor>;
    /// The attention op over a whole prompt: the core (`kern::attention_core`) of every query
    /// of q [t, h·dh] (position = row; dims.q0 = dims.kv0 = 0) over its window in kv [t, dh] and
    /// the compressed rows of cmp [n_c, dh] that `keys` gives it, rounded, inverse RoPE on dims
    /// [nope, dh) with the table's row p for the query at p, rounded: [t, h·dh]. The queries run
    /// `chunk` at a time (`--chunk`: what one pass holds), with the same bits for any chunk. A
    /// selection entry that is neither −1 nor a row < n_c is a usage error
    /// (`kern::selection_error_msg`).
    fn attention(
        &self,
        q: &Tensor,
        kv: &Tensor,
        cmp: &Tensor,
        keys: CmpRows,
        sink: &[f32],
        dims: AttnDims,
        nope: usize,
        tab: &RopeTable,
        chunk: usize,
    ) -> Result<Tensor>;
    /// The compressor's tail: gated softmax pooling of a/g [n_c·ratio, w] with `ape`, RMSNorm with
    /// `norm`, RoPE on the last dims at position b·ratio, each step rounded: [n_c, dc].
    fn compress_tail(
        &self,
        a: &Tensor,
        g: &Tensor,
        ape: &[f32],
        norm: &[f32],
        n_c: usize,
        dc: usize,
        ratio: usize,
        eps: f32,
        tab: &RopeTable,
    ) -> Result<Tensor>;
    /// The indexer's selection (`kern::indexer_topk`): q [t, hi·di] against ki [n_c, di] with
    /// the head weights w [t, hi] times `w_scale` (an f32 product) → [t, kk] row indices as f32,
    /// ascending, −1 after the last. The scores exist only a block of queries at a time
    /// (`kern::score_block_rows`) and stay where the device computes them.
    fn indexer_topk(
        &self,
        q: &Tensor,
        ki: &Tensor,
        w: &Tensor,
        w_scale: f32,
        d: IndexerDims,
    ) -> Result<Tensor>;
    /// The router's top-k from the logits [t, e] with the selection bias: (weights [t, k],
    /// expert ids [t, k]).
    fn route(&self, logits: &Tensor, bias: &[f32], r: Routing) -> Result<(Vec<f32>, Vec<usize>)>;
    /// A hash router's weights [t, k] for the expert ids `idx` [t, k] its table gives
    /// (`kern::hash_route_weights`; the ids are checked, < e).
    fn hash_route(&self, logits: &Tensor, idx: &[usize], r: Routing) -> Result<Vec<f32>>;
    /// a + b (equal shapes).
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// SwiGLU with the clamp on the stored gate and up projections:
    /// silu(min(g, L)) · clamp(u, ±L) (no clamp when L ≤ 0).
    fn swiglu(&self, g: &Tensor, u: &Tensor, limit: f32) -> Result<Tensor>;

    // ---- the model families' ops (`model::family`; host references in `family`) ----

    /// RoPE of dims [nope, dh) of each head of width dh of each row of x [t, k·dh] at position
    /// = row, with transformers' half-split pairing (dim nope + i with nope + i + half:
    /// `RopeTable::apply_split`).
    fn rope_split(&self, x: &Tensor, dh: usize, nope: usize, tab: &RopeTable) -> Result<Tensor>;
    /// Columns [c0, c0 + w) of each row of x [.., cols] → [rows, w] (a copy, no rounding).
    fn slice_cols(&self, x: &Tensor, c0: usize, w: usize) -> Result<Tensor>;
    /// Causal grouped-query attention (`family::gqa_core`) of q [t, h·dq] over k [q0 + t, kvh·dq]
    /// and v [q0 + t, kvh·dv] (`q0` keys of earlier token chunks first) with the heads' sink
    /// logits, if any → [t, h·dv], rounded. One query's scores per task at a time, never [t, t].
    fn gqa(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        sinks: Option<&[f32]>,
        dims: GqaDims,
    ) -> Result<Tensor>;
    /// MLA's keys [t, h·(nope + rope)] and values [t, h·dv] from `kv_b` [t, h·(nope + dv)] and
    /// the rope-applied `kv_a` [t, lora + rope] (`family::mla_keys`; a copy, no rounding).
    fn mla_keys(&self, kvb: &Tensor, kva: &Tensor, d: MlaDims) -> Result<(Tensor, Tensor)>;
    /// gpt-oss's clamped GLU (`family::glu_pairs`) of the gate and up projections → [n, I],
    /// rounded.
    fn glu_oss(&self, gu: GluIn<'_>, limit: f32) -> Result<Tensor>;
    /// Rows `r` of each part (along the first dimension), one part after the other →
    /// [Σ rows, …] with the first part's trailing shape (a copy, no rounding): what a run in
    /// token chunks joins, the rows carried from earlier chunks (a window's last rows, the
    /// compressed rows so far) and the chunk's own.
    fn cat_rows(&self, parts: &[(&Tensor, std::ops::Range<usize>)]) -> Result<Tensor>;
    /// Rows x [n, dh] as an engine's FP8 cache gives them back (`--served-chunk`: the keys of
    /// earlier prefill chunks): dims [0, nope) quantize-dequantized per row and per `group` with
    /// a power-of-two scale, the rest as they are (`numerics::fp8_block::fake_quant_kv_cache`).
    fn kv_cache_fp8(&self, x: &Tensor, nope: usize, group: usize) -> Result<Tensor>;
}

/// The gate and up projections gpt-oss's GLU pairs unit by unit ([`Device::glu_oss`]).
#[derive(Clone, Copy)]
pub enum GluIn<'a> {
    /// One fused projection [n, 2I] (the release's `w13`): gate i at column 2i, up i at 2i + 1.
    Interleaved(&'a Tensor),
    /// Gate [n, I] and up [n, I] as separate projections (llm-compressor's linear experts).
    Split(&'a Tensor, &'a Tensor),
}

impl GluIn<'_> {
    /// (rows n, units I), or why the projections do not pair (every device's check).
    pub fn dims(&self) -> Result<(usize, usize)> {
        match *self {
            GluIn::Interleaved(gu) => {
                let c = gu.cols();
                if !c.is_multiple_of(2) {
                    return Err(crate::Error::usage(format!(
                        "gate/up rows of {c} values are not interleaved pairs"
                    )));
                }
                Ok((gu.rows(), c / 2))
            }
            GluIn::Split(g, u) => {
                if g.shape != u.shape {
                    return Err(crate::Error::usage(format!(
                        "gate {:?} and up {:?} projections of different shapes",
                        g.shape, u.shape
                    )));
                }
                Ok((g.rows(), g.cols()))
            }
        }
    }
}

/// The shape and row width of [`Device::cat_rows`]'s output, or why the parts do not join.
pub fn cat_shape(parts: &[(&Tensor, std::ops::Range<usize>)]) -> Result<(Vec<usize>, usize)> {
    let Some((first, _)) = parts.first() else {
        return Err(crate::Error::usage("cat_rows: no parts"));
    };
    let tail: Vec<usize> = first.shape.iter().skip(1).copied().collect();
    let width: usize = tail.iter().product();
    let mut rows = 0;
    for (t, r) in parts {
        let n0 = t.shape.first().copied().unwrap_or(0);
        if t.shape.iter().skip(1).copied().collect::<Vec<_>>() != tail
            || r.start > r.end
            || r.end > n0
        {
            return Err(crate::Error::usage(format!(
                "cat_rows: rows {r:?} of shape {:?} do not join rows of shape {:?}",
                t.shape, first.shape
            )));
        }
        rows += r.len();
    }
    let mut shape = vec![rows];
    shape.extend(tail);
    Ok((shape, width))
}
