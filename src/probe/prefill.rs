//! The served path as an engine's chunked prefill runs it (`--served-chunk N`,
//! `served::engine`): the ops whose rows depend on earlier tokens (the compressors, the indexer,
//! the attention) run over the engine's chunks of N tokens one after the other, each chunk
//! taking what the chunk before left (`OpEnv::take_carry`, as a run in token chunks does,
//! `probe::chunked`), its attention and its indexer reading the earlier chunks' keys from their
//! FP8 caches (`OpEnv::cached_before`, `model::attn`). The engine faults (`--engine-fault`) change what
//! crosses a boundary (`rope-position-reset` also splits the RoPE ops it targets, their positions
//! counted from each engine chunk's start). Every other op, and the oracles, run as they would without it. Inside a
//! run in token chunks the engine's chunks are cut at the same multiples of N.

use super::env::PathEnv;
use crate::model::attn::{blocks_at, op_state_keys, window_key};
use crate::model::env::ChunkAt;
use crate::model::exec::OpEnv;
use crate::model::graph::{Op, OpKind};
use crate::served::engine::{EngineFaultKind, Prefill};
use crate::served::PathKind;
use crate::{Error, Result, Tensor};

/// True for the ops whose served numerics change when the prompt is prefilled in chunks of
/// `prefill`: those whose rows depend on earlier tokens, and the RoPE ops of a layer that
/// [`EngineFaultKind::RopePositionReset`] targets.
pub fn splits(op: &Op, prefill: &Prefill) -> bool {
    matches!(
        op.kind,
        OpKind::Compressor | OpKind::Indexer | OpKind::Attention
    ) || resets_positions(op, prefill)
}

/// A RoPE op whose positions the engine counts from each chunk's start (`rope-position-reset`).
fn resets_positions(op: &Op, prefill: &Prefill) -> bool {
    matches!(op.kind, OpKind::QRope | OpKind::KvRope)
        && prefill.has(EngineFaultKind::RopePositionReset, op.layer.unwrap_or(0))
}

/// The engine chunks of `prefill` inside the tokens `at`: cut at the multiples of its size.
pub fn engine_chunks(prefill: &Prefill, at: ChunkAt) -> Vec<ChunkAt> {
    let mut out = Vec::new();
    let mut s = at.start;
    while s < at.end {
        let e = (prefill.chunk_start(s) + prefill.chunk).min(at.end);
        out.push(ChunkAt {
            start: s,
            end: e,
            total: at.total,
        });
        s = e;
    }
    out
}

/// Runs `op` on `inputs` in `env`'s numerics (`model::exec`); on the served path under
/// `--served-chunk`, an op of [`splits`] runs engine chunk by engine chunk and its outputs are
/// joined.
pub fn exec(op: &Op, inputs: &[&Tensor], env: &mut PathEnv) -> Result<Vec<Tensor>> {
    let prefill = match (&env.shared.prefill, env.kind) {
        (Some(p), PathKind::Served) if splits(op, p) => p.clone(),
        _ => return crate::model::exec(op, inputs, env),
    };
    let reset = resets_positions(op, &prefill);
    let t = inputs.first().map_or(0, |x| x.rows());
    let outer = env.shared.at;
    let at = outer.unwrap_or(ChunkAt {
        start: 0,
        end: t,
        total: t,
    });
    let subs = engine_chunks(&prefill, at);
    if subs.len() <= 1 && outer.is_none() {
        // the whole prompt is one engine chunk
        return crate::model::exec(op, inputs, env);
    }
    let layer = op.layer.unwrap_or(0);
    let ratio = env.shared.cfg.ratio(layer);
    let mut parts: Vec<Vec<Tensor>> = Vec::with_capacity(subs.len());
    for sub in subs {
        let ins = sub_inputs(env, op, inputs, at, sub, ratio)?;
        let refs: Vec<&Tensor> = ins.iter().collect();
        if sub.start > 0 && sub.start == prefill.chunk_start(sub.start) {
            boundary_faults(env, op, &prefill, layer);
        }
        env.shared.at = Some(if reset {
            // the engine's positions: from its chunk's first token
            let c0 = prefill.chunk_start(sub.start);
            ChunkAt {
                start: sub.start - c0,
                end: sub.end - c0,
                total: sub.total,
            }
        } else {
            sub
        });
        let r = crate::model::exec(op, &refs, env);
        env.shared.at = outer;
        parts.push(r?);
    }
    join(env, op, parts)
}

/// The rows of `inputs` (over the tokens `at`) that engine chunk `sub` reads: a token-major
/// input's rows of its tokens, the attention's compressed rows (input 2) the blocks it completes.
fn sub_inputs(
    env: &PathEnv,
    op: &Op,
    inputs: &[&Tensor],
    at: ChunkAt,
    sub: ChunkAt,
    ratio: usize,
) -> Result<Vec<Tensor>> {
    let dev = env.device();
    let n = at.end - at.start;
    let mut out = Vec::with_capacity(inputs.len());
    for (i, x) in inputs.iter().enumerate() {
        let r = if op.kind == OpKind::Attention && i == 2 && ratio > 0 {
            let b0 = blocks_at(at, ratio).1;
            let (_, s0, s1) = blocks_at(sub, ratio);
            s0 - b0..s1 - b0
        } else if x.rows() == n {
            sub.start - at.start..sub.end - at.start
        } else {
            return Err(Error::usage(format!(
                "internal: {} input {i} has {} rows for {n} tokens",
                op.id,
                x.rows()
            )));
        };
        out.push(if r.start == 0 && r.end == x.rows() {
            (*x).clone()
        } else {
            dev.cat_rows(&[(x, r)])?
        });
    }
    Ok(out)
}

/// What the engine faults do to the state crossing an engine chunk boundary of `op`.
fn boundary_faults(env: &mut PathEnv, op: &Op, prefill: &Prefill, layer: usize) {
    let slot = env.shared.carry_slot;
    let mut keys = Vec::new();
    if prefill.has(EngineFaultKind::CompressorStateLost, layer) {
        keys.extend(op_state_keys(op));
    }
    if prefill.has(EngineFaultKind::WindowContextZeroed, layer) && op.kind == OpKind::Attention {
        keys.push(window_key(&op.id));
    }
    for k in keys {
        if let Some(t) = env.shared.carry.get_mut(&(slot, k)) {
            *t = Tensor::new(t.shape.clone(), vec![0.0; t.numel()]);
        }
    }
}

/// Each output's engine-chunk pieces, one after the other.
fn join(env: &PathEnv, op: &Op, mut parts: Vec<Vec<Tensor>>) -> Result<Vec<Tensor>> {
    if parts.len() == 1 {
        return Ok(parts.pop().unwrap_or_default());
    }
    let dev = env.device();
    (0..op.outputs.len())
        .map(|k| {
            let pieces: Vec<(&Tensor, std::ops::Range<usize>)> = parts
                .iter()
                .map(|p| {
                    let x = &p[k];
                    (x, 0..x.rows())
                })
                .collect();
            dev.cat_rows(&pieces)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engine_chunks_cut_at_multiples_of_the_size() {
        let p = Prefill::new(64, vec![]).unwrap();
        let whole = ChunkAt {
            start: 0,
            end: 150,
            total: 150,
        };
        let c: Vec<(usize, usize)> = engine_chunks(&p, whole)
            .iter()
            .map(|c| (c.start, c.end))
            .collect();
        assert_eq!(c, [(0, 64), (64, 128), (128, 150)]);
        // a run's token chunk [100, 140) of 150: the engine's boundary at 128 inside it
        let part = ChunkAt {
            start: 100,
            end: 140,
            total: 150,
        };
        let c: Vec<(usize, usize)> = engine_chunks(&p, part)
            .iter()
            .map(|c| (c.start, c.end))
            .collect();
        assert_eq!(c, [(100, 128), (128, 140)]);
    }
}
