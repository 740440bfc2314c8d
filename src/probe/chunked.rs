//! The runner over the prompt in token chunks (`--chunk N`, or chosen from the memory budget):
//! the op graph is cut where its layer changes (the embedding, each layer, the head) and each
//! such segment runs chunk by chunk of N tokens, every op of the segment on the chunk before
//! the next chunk begins. What a later token needs of earlier ones the ops carry themselves
//! (`OpEnv::take_carry`: the window's KV rows, the compressors' pending rows, the compressed
//! keys so far; `model::attn`), so every path computes what one pass over the prompt computes.
//!
//! Between segments only the tensors a later segment reads survive, one piece per chunk (a
//! layer's output streams): on the host, so that device memory holds one chunk's activations,
//! or on the device when the budget holds them (`budget::streams_fit_device`). Each op's
//! record is merged over its chunks: statistics and comparisons stream (on the host with the
//! sums of one pass, `metrics::Stream`; on a device each chunk's sums merged,
//! `metrics::Partial::merge_later`), counts add, kept outputs join.
//!
//! What a chunked run does not do: follow a divergent op's error into its consumers (the
//! consequence tracker needs the whole faulty output before its consumers run; a divergent op
//! is then counted harmful, never absorbed) or keep bisect's captures (bisect replays from the
//! oracle instead). The loader stages an op's weights ahead for the first chunk; on a device they
//! stay for the segment's later chunks (`Shared::hold_weights`), on the host later chunks read
//! them again.

use std::collections::{HashMap, HashSet};
use std::ops::Range;
use std::time::Instant;

use super::progress::Progress;
use super::runner::{compressed_ratio, execs, keep_outputs, kept_rows, Execs, Stepper};
use super::{is_index_output, measure_launch, op_record_finish, PendingRecord, PAIRS};
use crate::backend::run::RunHooks;
use crate::backend::PendingStats;
use crate::metrics::{Partial, Stream};
use crate::model::env::ChunkAt;
use crate::model::graph::Op;
use crate::served::LinearObs;
use crate::{Error, Result, Tensor};

/// Runs `ops` over the prompt in chunks of `chunk` tokens; records go to `st.records`.
pub(super) fn run<'a>(
    st: &mut Stepper<'a>,
    ops: &'a [Op],
    chunk: usize,
    on_device: bool,
    hooks: &dyn RunHooks,
    pb: &mut Progress,
) -> Result<()> {
    let total = st.opts.tokens.len();
    let chunks: Vec<ChunkAt> = (0..total)
        .step_by(chunk.max(1))
        .map(|start| ChunkAt {
            start,
            end: (start + chunk).min(total),
            total,
        })
        .collect();
    // the last op to run (`stop_after`)
    let end = match &st.opts.stop_after {
        Some(id) => ops
            .iter()
            .position(|o| &o.id == id)
            .map_or(ops.len(), |i| i + 1),
        None => ops.len(),
    };
    let mut pieces = Pieces::default();
    let mut s0 = 0;
    while s0 < end {
        let layer = ops[s0].layer;
        let s1 = (s0..end).find(|&i| ops[i].layer != layer).unwrap_or(end);
        segment(st, ops, s0..s1, &chunks, &mut pieces, on_device, hooks, pb)?;
        s0 = s1;
    }
    st.shared.tokens = st.opts.tokens.clone();
    Ok(())
}

/// Tensors that outlive their segment: per id, per path, one piece per chunk (taken by the
/// segment that reads them last).
#[derive(Default)]
struct Pieces(HashMap<String, [Vec<Option<Tensor>>; 3]>);

#[allow(clippy::too_many_arguments)]
/// Runs the ops `seg` (one layer's, or the ops outside layers) chunk by chunk, then records
/// them.
fn segment<'a>(
    st: &mut Stepper<'a>,
    ops: &'a [Op],
    seg: Range<usize>,
    chunks: &[ChunkAt],
    pieces: &mut Pieces,
    on_device: bool,
    hooks: &dyn RunHooks,
    pb: &mut Progress,
) -> Result<()> {
    let last = seg.end - 1;
    let made: HashSet<&str> = ops[seg.clone()]
        .iter()
        .flat_map(|o| o.outputs.iter().map(String::as_str))
        .collect();
    let outlives = |id: &str| st.last_use.get(id).is_some_and(|&l| l > last);
    let leaving: Vec<String> = made
        .iter()
        .filter(|id| outlives(id))
        .map(|id| id.to_string())
        .collect();
    let mut accs: Vec<Option<Acc>> = (0..seg.len()).map(|_| None).collect();
    let mut out = Pieces::default();
    // on a device the segment's weights stay for all its chunks (read once, not once a chunk);
    // the host reference decodes them per op as always (three f32 copies of a layer would not fit)
    st.shared.hold_weights = st.opts.backend.on_device() && chunks.len() > 1;
    for (c, at) in chunks.iter().enumerate() {
        st.shared.at = Some(*at);
        st.shared.tokens = st.opts.tokens[at.start..at.end].to_vec();
        // the chunk's rows of what earlier segments made (taken when this segment reads them last)
        let mut maps: [HashMap<String, Tensor>; 3] = Default::default();
        for (id, per) in pieces.0.iter_mut() {
            let keep = st.last_use.get(id.as_str()).is_some_and(|&l| l > last);
            for (pi, v) in per.iter_mut().enumerate() {
                let t = match keep {
                    true => v[c].clone(),
                    false => v[c].take(),
                };
                if let Some(t) = t {
                    maps[pi].insert(id.clone(), t);
                }
            }
        }
        for (k, step) in seg.clone().enumerate() {
            let op = &ops[step];
            if c == 0 {
                hooks.before_op(step);
            }
            pb.start(op);
            let t_op = Instant::now();
            let r = chunk_step(st, step, op, &mut maps, &mut accs[k], c, *at, hooks, last);
            if let Err(e) = r {
                st.shared.cancel_op();
                st.shared.carry.clear();
                st.shared.hold_weights = false;
                st.shared.release_weights();
                return Err(crate::backend::oom::explain(e, &op.id, &st.opts.backend));
            }
            if c + 1 == chunks.len() {
                pb.done();
            }
            *st.prof.entry(format!("{:?}", op.kind)).or_default() += t_op.elapsed().as_secs_f64();
        }
        // what later segments read, one piece per chunk: on the host, unless the budget holds
        // them on the device
        for id in &leaving {
            let per = out.0.entry(id.clone()).or_default();
            for (pi, m) in maps.iter_mut().enumerate() {
                let piece = m.remove(id).map(|t| match on_device {
                    true => t,
                    false => Tensor::new(t.shape.clone(), t.data.clone().into_vec()),
                });
                per[pi].push(piece);
            }
        }
    }
    st.shared.carry.clear();
    st.shared.at = None;
    st.shared.hold_weights = false;
    st.shared.release_weights();
    pieces
        .0
        .retain(|id, _| st.last_use.get(id.as_str()).is_some_and(|&l| l > last));
    pieces.0.extend(out.0);
    for acc in accs.into_iter().flatten() {
        let t_m = Instant::now();
        let (rec, kept) = acc.finish()?;
        let r = op_record_finish(st.ckpt, st.opts, rec)?;
        st.records.push(r);
        for (name, ts) in kept {
            st.outputs.entry(name).or_default().extend(ts);
        }
        *st.prof.entry("(metrics)".into()).or_default() += t_m.elapsed().as_secs_f64();
    }
    Ok(())
}

/// Op `step` over chunk `c` on every path (inputs from `maps`, its outputs put there); a
/// reported op's measurements go into `acc`.
#[allow(clippy::too_many_arguments)]
fn chunk_step(
    st: &mut Stepper,
    step: usize,
    op: &Op,
    maps: &mut [HashMap<String, Tensor>; 3],
    acc: &mut Option<Acc>,
    c: usize,
    at: ChunkAt,
    hooks: &dyn RunHooks,
    last: usize,
) -> Result<()> {
    let opts = st.opts;
    let report = op.layer.is_none_or(|l| l >= st.a) && opts.spec.selects(&op.id);
    let ex = execs(&mut st.shared, op, maps, report, st.opts.experts, |outs| {
        // the loader follows the routing of the first chunk
        if c == 0 {
            hooks.routed(step, outs)
        }
    })?;
    if report {
        let ratio = compressed_ratio(&st.shared.cfg, op);
        acc.get_or_insert_with(|| Acc::new(step, op, opts.backend.on_device()))
            .add(st, &ex, at, ratio)?;
    }
    st.shared.clear();
    keep_outputs(op, ex.outs, maps)?;
    // drop what no later op of the chunk reads and no later segment needs
    for m in maps.iter_mut() {
        m.retain(|id, _| {
            st.last_use
                .get(id.as_str())
                .is_some_and(|&l| l > step || l > last)
        });
    }
    if let Some(e) = crate::tensor::take_device_error() {
        return Err(Error::Backend(format!("op {}: {e}", op.id)));
    }
    Ok(())
}

/// One reported op's measurements, merged over the chunks.
struct Acc {
    step: usize,
    op: Op,
    shape: Vec<usize>,
    touched: Vec<String>,
    touched_set: HashSet<String>,
    observed: Vec<(String, LinearObs)>,
    sums: Sums,
    /// Kept outputs (`--dump`): per path name, per output id, the chunks' pieces.
    kept: Vec<(String, KeptPieces)>,
    /// The head's next-token comparisons, chunk by chunk.
    head: Option<super::HeadMetrics>,
    /// A routed-experts op's experts one by one, chunk by chunk.
    per_expert: Option<super::experts::PerExpert>,
}

/// One path's kept outputs of an op: per output id, the chunks' pieces.
type KeptPieces = Vec<(String, Vec<Tensor>)>;
/// One path's kept outputs of an op, joined: per output id, the tensor.
type Kept = Vec<(String, Tensor)>;

/// The statistics so far: on the host one stream per metric item (the sums of one pass), on a
/// device each chunk's sums merged.
enum Sums {
    Host(Vec<Stream>),
    Device(Vec<Partial>),
}

/// The paths' names in records and dumps, in the order of [`Acc::add`]'s outputs.
const KEPT: [&str; 4] = ["oracle_fp32", "oracle_bf16", "served", "served_isolated"];

impl Acc {
    fn new(step: usize, op: &Op, device: bool) -> Acc {
        let sums = match device {
            true => Sums::Device(Vec::new()),
            false => Sums::Host(
                PAIRS
                    .iter()
                    .map(|&(_, r)| Stream::new(1 + r.is_some() as usize, &[(0, r.map(|_| 1))]))
                    .collect(),
            ),
        };
        Acc {
            step,
            op: op.clone(),
            shape: Vec::new(),
            touched: Vec::new(),
            touched_set: HashSet::new(),
            observed: Vec::new(),
            sums,
            kept: KEPT.iter().map(|n| (n.to_string(), Vec::new())).collect(),
            head: super::is_head(op).then(super::HeadMetrics::default),
            per_expert: None,
        }
    }

    /// Add one chunk's executions (`at`; `ratio` for a compressor's output rows).
    fn add(&mut self, st: &Stepper, ex: &Execs, at: ChunkAt, ratio: Option<usize>) -> Result<()> {
        let opts = st.opts;
        let (fp, bf, sv, is, fb) = (
            &ex.outs[0][0],
            &ex.outs[1][0],
            &ex.outs[2][0],
            &ex.iso[0],
            &ex.fp_on_bf[0],
        );
        match &mut self.sums {
            Sums::Host(streams) => {
                let t = [
                    &fp.data[..],
                    &bf.data[..],
                    &sv.data[..],
                    &is.data[..],
                    &fb.data[..],
                ];
                for (s, &(i, r)) in streams.iter_mut().zip(PAIRS.iter()) {
                    match r {
                        Some(j) => s.feed(&[t[i], t[j]]),
                        None => s.feed(&[t[i]]),
                    }
                }
            }
            Sums::Device(acc) => {
                // the record's own metrics launch, read back now: the chunk's sums
                let p = measure_launch(&opts.backend, fp, bf, sv, is, fb)?;
                let parts = opts.backend.stats_partials(p)?;
                if acc.is_empty() {
                    *acc = parts;
                } else {
                    acc.iter_mut()
                        .zip(&parts)
                        .for_each(|(a, b)| a.merge_later(b));
                }
            }
        }
        if let Some(h) = &mut self.head {
            h.add(fp, bf, sv);
        }
        if let Some(rows) = &ex.per_expert {
            self.per_expert
                .get_or_insert_with(Default::default)
                .add_rows(rows);
        }
        match self.shape.first_mut() {
            Some(rows) => *rows += sv.shape.first().copied().unwrap_or(0),
            None => self.shape = sv.shape.clone(),
        }
        for b in &ex.touched {
            if self.touched_set.insert(b.clone()) {
                self.touched.push(b.clone());
            }
        }
        self.observed.extend(ex.observed.iter().cloned());
        if opts.keep_outputs {
            for (k, ts) in [&ex.outs[0], &ex.outs[1], &ex.outs[2], &ex.iso]
                .into_iter()
                .enumerate()
            {
                let per = &mut self.kept[k].1;
                for (o, (id, t)) in self.op.outputs.iter().zip(ts).enumerate() {
                    if per.len() <= o {
                        per.push((id.clone(), Vec::new()));
                    }
                    let piece = match &opts.keep_rows {
                        Some(rows) => kept_rows(t, rows, at, ratio),
                        None => Tensor::new(t.shape.clone(), t.data.clone().into_vec()),
                    };
                    per[o].1.push(piece);
                }
            }
        }
        Ok(())
    }

    /// The record to finish and the kept outputs, joined over the chunks.
    fn finish(self) -> Result<(PendingRecord, Vec<(String, Kept)>)> {
        let parts = match self.sums {
            Sums::Host(streams) => streams
                .into_iter()
                .map(|s| s.partials().remove(0))
                .collect(),
            Sums::Device(p) => p,
        };
        let kept = self
            .kept
            .into_iter()
            .filter(|(_, per)| !per.is_empty())
            .map(|(name, per)| {
                let v = per
                    .into_iter()
                    .map(|(id, ps)| (id, join_rows(ps)))
                    .collect();
                (name, v)
            })
            .collect();
        let index_output = is_index_output(&self.op);
        Ok((
            PendingRecord {
                step: self.step,
                op: self.op,
                shape: self.shape,
                touched: self.touched,
                observed: self.observed,
                index_output,
                metrics: PendingStats::Done(parts),
                head: self.head,
                per_expert: self.per_expert,
            },
            kept,
        ))
    }
}

/// The pieces' rows, in order (host values).
fn join_rows(ps: Vec<Tensor>) -> Tensor {
    let mut shape = ps.first().map_or_else(|| vec![0], |p| p.shape.clone());
    if let Some(r) = shape.first_mut() {
        *r = ps
            .iter()
            .map(|p| p.shape.first().copied().unwrap_or(0))
            .sum();
    }
    let data: Vec<f32> = ps.into_iter().flat_map(|p| p.data.into_vec()).collect();
    Tensor::new(shape, data)
}
