//! What an engine or transformers tensor name maps to: the op id and the layout of its rows
//! ([`Mapped`]), and how an engine's pieces of it (fused parts, ranks) make the op's output
//! ([`Rule`]). Its own file so that V4's name
//! maps (`names.rs`) and the families' (`family_names.rs`, `engine_names.rs`) share it without
//! importing each other both ways.

/// How a trace tensor relates to the op output it maps to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapped {
    pub op: String,
    /// True when the tensor's rows are token rows (so `rows` metadata selects them); false for
    /// compressed rows, indexer picks and other non-token layouts, which are kept whole.
    pub token_rows: bool,
}

/// `model.layers.3.attn.wq_b` → (3, `attn.wq_b`), `model.layers.3:residual` → (3, `:residual`).
pub(super) fn layer_and_rest<'a>(name: &'a str, prefix: &str) -> Option<(usize, &'a str)> {
    let r = name.strip_prefix(prefix)?;
    let (n, rest) = match r.find(['.', ':']) {
        Some(i) if r.as_bytes()[i] == b'.' => (&r[..i], &r[i + 1..]),
        Some(i) => (&r[..i], &r[i..]),
        None => (r, ""),
    };
    Some((n.parse().ok()?, rest))
}

/// How per-rank files of one tensor combine into the logical tensor (tensor parallelism).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shard {
    /// Every rank holds the whole tensor (replicated layers, row-parallel outputs after the all-reduce).
    Replicated,
    /// Column-parallel outputs: concatenate along this dim (negative counts from the end).
    Concat(i64),
    /// Partial sums that the engine all-reduces later (MoE outputs with `reduce_results=False`). When every
    /// rank holds the same values the tensor was already reduced and rank 0's copy is used.
    Sum,
}

/// A slice of a fused output along `dim` (negative counts from the end), in logical (unsharded) units.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(deny_unknown_fields)]
pub struct Split {
    pub dim: i64,
    pub start: usize,
    pub len: usize,
}

/// One op a trace tensor feeds, and how to turn the tensor (or its per-rank pieces) into that op's output.
#[derive(Clone, Debug, PartialEq)]
pub struct Rule {
    pub op: String,
    /// See [`Mapped::token_rows`].
    pub token_rows: bool,
    /// Fused projections: the slice of the tensor that is this op's output.
    pub split: Option<Split>,
    pub shard: Shard,
    /// Per-head width of a head-major last dimension: engines pad heads (vLLM/FlashMLA to 64 or 128 per
    /// rank), and the columns beyond the config's head count are dropped.
    pub head_dim: Option<usize>,
    /// The op's columns are heads, split over ranks by head: each rank's piece is folded to
    /// [rows, local heads · width] before the ranks are joined (engines that norm per head hold
    /// them as [rows · heads, width] or [rows, heads, width]).
    pub per_head: Option<PerHead>,
    /// A constant the engine multiplies in after this tensor (vLLM's `routed_scaling_factor`
    /// applied to the routed experts' sum in its caller): the joined tensor is multiplied by it.
    pub scale: Option<f32>,
}

/// The head layout of an op's columns (see [`Rule::per_head`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PerHead {
    /// Heads in the logical (unsharded) op.
    pub heads: usize,
    /// Width of one head.
    pub width: usize,
}

impl Rule {
    pub(super) fn plain(op: String, token_rows: bool) -> Rule {
        Rule {
            op,
            token_rows,
            split: None,
            shard: Shard::Replicated,
            head_dim: None,
            per_head: None,
            scale: None,
        }
    }
    pub(super) fn concat(mut self, dim: i64) -> Rule {
        self.shard = Shard::Concat(dim);
        self
    }
    pub(super) fn sum(mut self) -> Rule {
        self.shard = Shard::Sum;
        self
    }
    pub(super) fn heads(mut self, dh: usize) -> Rule {
        self.head_dim = Some(dh);
        self
    }
    pub(super) fn split(mut self, start: usize, len: usize) -> Rule {
        self.split = Some(Split {
            dim: -1,
            start,
            len,
        });
        self
    }
    /// Column-parallel over `heads` heads of `width` (see [`Rule::per_head`]).
    pub(super) fn per_head(mut self, heads: usize, width: usize) -> Rule {
        self.shard = Shard::Concat(-1);
        self.per_head = Some(PerHead { heads, width });
        self
    }
    pub(super) fn scaled(mut self, f: f32) -> Rule {
        self.scale = Some(f);
        self
    }
}
