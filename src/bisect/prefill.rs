//! The hypothesis about an engine's chunked prefill (`--served-chunk`): an op whose rows depend
//! on earlier tokens (a compressor, the indexer, the attention) or on their positions (RoPE under
//! `rope-position-reset`) that diverges only because the prompt was prefilled in chunks. Its test is one replay of the op with the prompt prefilled
//! whole (`Replayer::eval_prefilled_whole`): when that brings the op back within its tolerance,
//! the state carried across the chunk boundaries is what is wrong.

use super::{Family, Hypothesis, ParamRef};
use crate::model::graph::OpKind;
use crate::probe::replay::Replayer;

/// The verdict kind.
pub(super) const KIND: &str = "prefill-chunk-state";

/// The hypothesis for the replayed op, when the run prefilled it in an engine's chunks.
pub(super) fn hypothesis(rp: &Replayer) -> Option<Hypothesis> {
    if !rp.prefills_in_chunks() {
        return None;
    }
    let op = &rp.cap.op;
    let (state, what) = match op.kind {
        OpKind::Compressor => (
            "the compressor's state cache",
            "the compressor's state across the engine's prefill chunks is wrong (the rows of a block still pending at a chunk boundary, and for ratio 4 the block before it, which the overlapping pool reads)",
        ),
        OpKind::QRope | OpKind::KvRope => (
            "the RoPE positions of later prefill chunks",
            "the positions RoPE rotates by in the engine's later prefill chunks are wrong (counted from the chunk's first token, or offset by another chunk's start)",
        ),
        OpKind::Indexer => (
            "the indexer's key cache and its compressor's state cache",
            "the indexer's state across the engine's prefill chunks is wrong (its compressor's pending rows or the compressed keys of earlier chunks)",
        ),
        _ => (
            "the KV cache",
            "the keys the attention reads from earlier prefill chunks are wrong (the sliding window's KV rows or the compressed rows in the engine's KV cache)",
        ),
    };
    Some(Hypothesis {
        kind: KIND.into(),
        unit: op.id.clone(),
        what: what.into(),
        param: ParamRef {
            family: Family::ChunkState,
            bases: Vec::new(),
            tensors: Vec::new(),
            engine: state.into(),
            current: None,
            corrected: None,
            stored: None,
            from_sibling: None,
        },
        patches: Vec::new(),
        prior: 4,
    })
}

/// What to do about a verdict of [`KIND`].
pub(super) fn fix(p: &ParamRef) -> String {
    if p.engine.starts_with("the RoPE positions") {
        return "the op is right over the whole prompt and wrong in later prefill chunks: check that the positions the engine builds for a chunk start at the chunk's offset in the request (its computed tokens so far), not at 0 (reproduce with the same --served-chunk; bisect's replay of the op prefilled whole restores it)".into();
    }
    format!(
        "the op is right over the whole prompt and wrong across chunk boundaries: check that {} is written at the end of each prefill chunk and read back at the start of the next, for the same request and slots (reproduce with the same --served-chunk; bisect's replay of the op prefilled whole restores it)",
        p.engine
    )
}
