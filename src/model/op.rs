//! An op of the forward pass as data: what it computes ([`OpKind`]), its class for reports and
//! tolerances ([`OpClass`]), and its stable id, inputs, outputs and checkpoint reads ([`Op`]).
//! The V4 graph ([`super::graph`]) and the other families' graphs ([`super::family::graph`]) are
//! both lists of these.

/// What an op computes. Input and weight order per kind:
/// - `Embed`: inputs []; weights [`embed`].
/// - `HcExpand`: inputs [embed].
/// - `HcPre`: inputs [X]; weights [fn, base, scale] (params); outputs [x, .post, .comb].
/// - `RmsNorm`: inputs [x]; weights [norm weight param].
/// - `Linear`: inputs [x]; weights [linear base]. Output stored (bf) except for `head` (fp32 logits).
/// - `GroupedLinear`: inputs [x [T, H·Dh]]; weights [wo_a base].
/// - `QRope`: inputs [q_b]. `KvRope`: inputs [kv_norm].
/// - `Compressor`: inputs [attn.norm]; weights [wkv base, wgate base, ape, norm weight].
/// - `Indexer`: inputs [attn.norm, attn.q_norm]; weights [wq_b base, weights_proj base,
///   compressor wkv base, compressor wgate base, compressor ape, compressor norm weight].
/// - `Attention`: inputs [q_rope, kv_rope, (compressor), (indexer)]; weights [attn_sink].
/// - `HcPost`: inputs [y, X, pre.post, pre.comb].
/// - `Router`: inputs [ffn.norm]; weights [gate base, tid2eid (hash layers) or gate.bias];
///   outputs [weights, .idx].
/// - `Experts`: inputs [ffn.norm, router, router.idx]; weights [w1, w3, w2 of expert 0, of expert 1, …].
/// - `SharedExpert`: inputs [ffn.norm]; weights [w1, w3, w2] bases.
/// - `Sum`: inputs [a, b] → bf(a + b).
/// - `HcHead`: inputs [X]; weights [hc_head_fn, hc_head_base, hc_head_scale].
///
/// Ops of the other families (`model::family`):
/// - `Linear` of a family with biases (gpt-oss): weights [linear base, bias param]: x @ Wᵀ + b,
///   stored once.
/// - `HeadNorm`: inputs [x [T, n·Dh]]; weights [norm weight [Dh]]: RMSNorm of each head.
/// - `HeadRope`: inputs [x [T, n·Dh]]: RoPE on each head's last rotary dims (the family's style).
/// - `GqaAttention`: inputs [q, k, v]; weights [] or [sinks]: causal grouped-query attention
///   (over the sliding window on a family's sliding layers).
/// - `Mlp`: inputs [x]; weights [gate, up, down] bases: a dense SwiGLU MLP.
/// - `LatentNorm`: inputs [x [T, r + more]]; weights [norm weight [r]]: RMSNorm of the leading r
///   dims (MLA's KV latent) → [T, r].
/// - `MlaAttention`: inputs [q [T, H·(nope+rope)] roped, kv_b [T, H·(nope+v)], kv_a [T, r+rope]
///   roped]: causal MLA, the rope key shared by the heads.
/// - `Router` of gpt-oss: weights [gate base, gate.bias]: the bias joins the logits; top-k of the
///   logits, softmax over the k.
/// - `GptOssExperts`: inputs as `Experts`; weights [w13, w13.bias, w2, w2.bias] per expert (w13's
///   rows gate and up interleaved), or [w1, w1.bias, w3, w3.bias, w2, w2.bias] (gate and up as
///   separate linears): (up + 1) · gate · σ(α · gate) with gate ≤ L, |up| ≤ L.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum OpKind {
    Embed,
    HcExpand,
    HcPre,
    RmsNorm,
    Linear,
    GroupedLinear,
    QRope,
    KvRope,
    Compressor,
    Indexer,
    Attention,
    HcPost,
    Router,
    Experts,
    SharedExpert,
    Sum,
    HcHead,
    HeadNorm,
    HeadRope,
    GqaAttention,
    Mlp,
    LatentNorm,
    MlaAttention,
    GptOssExperts,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum OpClass {
    Embed,
    /// mHC (hyper-connection) mixing: expand, pre, post, head collapse.
    Mix,
    Norm,
    Linear,
    Rope,
    Attention,
    Compressor,
    Indexer,
    Router,
    Moe,
    Elementwise,
    Head,
}

impl OpClass {
    /// Every class, as the run JSON's `class` field spells them (the variant names).
    pub const ALL: [OpClass; 12] = [
        OpClass::Embed,
        OpClass::Mix,
        OpClass::Norm,
        OpClass::Linear,
        OpClass::Rope,
        OpClass::Attention,
        OpClass::Compressor,
        OpClass::Indexer,
        OpClass::Router,
        OpClass::Moe,
        OpClass::Elementwise,
        OpClass::Head,
    ];

    /// The class's name in the run JSON (serde writes the variant name).
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Embed => "Embed",
            OpClass::Mix => "Mix",
            OpClass::Norm => "Norm",
            OpClass::Linear => "Linear",
            OpClass::Rope => "Rope",
            OpClass::Attention => "Attention",
            OpClass::Compressor => "Compressor",
            OpClass::Indexer => "Indexer",
            OpClass::Router => "Router",
            OpClass::Moe => "Moe",
            OpClass::Elementwise => "Elementwise",
            OpClass::Head => "Head",
        }
    }
}

#[derive(Clone, Debug, serde::Serialize)]
pub struct Op {
    pub id: String,
    pub kind: OpKind,
    pub class: OpClass,
    pub layer: Option<usize>,
    /// Ids of tensors consumed (op ids or aux ids).
    pub inputs: Vec<String>,
    /// `outputs[0] == id`; auxiliary outputs after it (e.g. `L0.attn.hc_pre.post`).
    pub outputs: Vec<String>,
    /// Canonical checkpoint names this op reads (bases for linears, e.g. `layers.0.attn.wq_a`).
    pub weights: Vec<String>,
}

pub(crate) fn op(
    id: String,
    kind: OpKind,
    class: OpClass,
    layer: Option<usize>,
    inputs: Vec<String>,
    weights: Vec<String>,
) -> Op {
    Op {
        outputs: vec![id.clone()],
        id,
        kind,
        class,
        layer,
        inputs,
        weights,
    }
}
