//! The three tensor namings of docs/DSV4-LAYER.md §2 and their mapping onto one canonical spelling:
//! the official DeepSeek names without prefix. Every consumer (model, lint, compare) speaks
//! canonical names only, so a checkpoint's naming is decided once, here.

use serde::Serialize;

/// Which naming a checkpoint uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Naming {
    /// `layers.N.attn.wq_a.weight`, no prefix (deepseek-ai and nvidia releases).
    Official,
    /// transformers module names: `model.layers.N.self_attn.q_a_proj.weight`, `mlp.experts…`.
    Hf,
    /// transformers `save_pretrained` output: `model.` prefix with official leaves.
    HfHybrid,
}

impl Naming {
    pub fn as_str(self) -> &'static str {
        match self {
            Naming::Official => "official",
            Naming::Hf => "hf",
            Naming::HfHybrid => "hf-hybrid",
        }
    }
}

/// Decide the naming from the raw tensor names. HF module names are recognised by their
/// HF-only components; a `model.` prefix without them is the save_pretrained hybrid.
pub fn detect<'a>(names: impl IntoIterator<Item = &'a str>) -> Naming {
    let mut prefixed = false;
    for n in names {
        if n.starts_with("lm_head.") {
            return Naming::Hf;
        }
        if let Some(rest) = n.strip_prefix("model.") {
            prefixed = true;
            if rest.contains(".self_attn.")
                || rest.contains(".mlp.")
                || rest.contains(".input_layernorm.")
                || rest.contains(".post_attention_layernorm.")
                || rest.contains(".attn_hc.")
                || rest.contains(".ffn_hc.")
            {
                return Naming::Hf;
            }
        }
    }
    if prefixed {
        Naming::HfHybrid
    } else {
        Naming::Official
    }
}

/// Which part of an HF fused expert tensor a canonical expert weight is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedPart {
    /// `gate_up_proj` [E, 2I, D], rows 0..I of expert E = w1.
    Gate,
    /// `gate_up_proj` rows I..2I = w3.
    Up,
    /// `down_proj` [E, D, I] = w2.
    Down,
    /// Expert E's whole slice as stored, its trailing dims flattened into one (gpt-oss's biases
    /// [E, n] → [n], MXFP4 blocks [E, out, in/32, 16] → [out, in/2], scales [E, out, in/32]).
    Whole,
    /// Expert E's whole slice of a tensor stored [E, in, out] (gpt-oss's BF16 `gate_up_proj`,
    /// `down_proj`; ModelOpt's NVFP4 bytes [E, in/2, out] and block scales [E, in/16, out]): the
    /// canonical tensor is its transpose, [out, in].
    Transposed,
    /// A tensor scale of a fused projection (ModelOpt's `gate_up_proj_weight_scale_2`,
    /// `_input_scale`): stored as a scalar, each expert's piece is the whole tensor; stored one
    /// per expert [E], `experts::per_expert` reads it as [`FusedPart::Whole`].
    Shared,
}

/// How a family's transformers class fuses its routed experts (`model::family::Kind`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FusedLayout {
    /// Qwen3-MoE, DeepSeek-V3 in transformers 5: `gate_up_proj` [E, 2I, D] (gate rows, then up
    /// rows) → per-expert w1 and w3, `down_proj` [E, D, I] → w2.
    Stacked,
    /// gpt-oss: `gate_up_proj` [E, D, 2I] with gate and up interleaved → per-expert `w13`
    /// (its rows interleaved: 2i gate, 2i + 1 up), `down_proj` [E, I, D] → `w2`, their biases
    /// `*_bias` [E, n] → `w13.bias`, `w2.bias`; a format's fused tensors (MXFP4 `*_blocks`,
    /// `*_scales`, [E, out, …]) → the per-expert data and block scale.
    Interleaved,
}

/// What a raw name stands for in canonical terms.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Canon {
    /// One canonical tensor.
    Plain(String),
    /// An HF fused expert tensor of layer prefix `prefix` (e.g. `layers.3`): `gate_up_proj` when
    /// `gate_up`, else `down_proj`. Expands to one canonical tensor per expert.
    Fused { prefix: String, gate_up: bool },
    /// An interleaved-layout fused tensor: expert e's `part` of it is the canonical
    /// `{prefix}.ffn.experts.{e}.{leaf}` (e.g. `w13.weight`, `w2.bias`, `w13.weight_scale`).
    PerExpert {
        prefix: String,
        leaf: String,
        part: FusedPart,
    },
}

/// Canonical name of a raw tensor name in the given naming, fused experts stacked.
pub fn canonical(raw: &str, naming: Naming) -> Canon {
    canonical_in(raw, naming, FusedLayout::Stacked)
}

/// Canonical name of a raw tensor name in the given naming and fused-expert layout.
pub fn canonical_in(raw: &str, naming: Naming, layout: FusedLayout) -> Canon {
    match naming {
        Naming::Official => Canon::Plain(raw.to_string()),
        Naming::HfHybrid => Canon::Plain(hybrid(raw)),
        Naming::Hf => hf(raw, layout),
    }
}

/// An interleaved-layout fused expert tensor (the tail after `mlp.experts.`): the per-expert leaf
/// and part, through the format table for a format's own fused tensors.
fn interleaved(tail: &str) -> Option<(String, FusedPart)> {
    let (proj, rest) = if let Some(r) = tail.strip_prefix("gate_up_proj") {
        ("w13", r)
    } else if let Some(r) = tail.strip_prefix("down_proj") {
        ("w2", r)
    } else {
        return None;
    };
    let (leaf, part) = match rest {
        "" => ("weight".to_string(), FusedPart::Transposed),
        "_bias" => ("bias".to_string(), FusedPart::Whole),
        _ => super::formats::TABLE.iter().find_map(|s| {
            let f = s.tensors.fused_experts.as_ref()?;
            let t = &s.tensors;
            let data = if f.transposed {
                FusedPart::Transposed
            } else {
                FusedPart::Whole
            };
            if rest == f.data_suffix {
                Some((t.weight_leaf.to_string(), data))
            } else if rest == f.scale_suffix {
                Some((t.scale_leaves.first()?.to_string(), data))
            } else if Some(rest) == f.global_suffix {
                // a scalar for every expert, or one per expert: `experts::per_expert` decides
                Some((t.global_leaf?.to_string(), FusedPart::Shared))
            } else if Some(rest) == f.input_suffix {
                Some((t.input_leaf?.to_string(), FusedPart::Shared))
            } else {
                None
            }
        })?,
    };
    Some((format!("{proj}.{leaf}"), part))
}

fn model_level(s: &str) -> Option<String> {
    let m = match s {
        "embed_tokens.weight" => "embed.weight",
        "hc_head.hc_fn" => "hc_head_fn",
        "hc_head.hc_base" => "hc_head_base",
        "hc_head.hc_scale" => "hc_head_scale",
        _ => return None,
    };
    Some(m.to_string())
}

fn hybrid(raw: &str) -> String {
    let Some(s) = raw.strip_prefix("model.") else {
        return raw.to_string();
    };
    if let Some(m) = model_level(s) {
        return m;
    }
    if let Some((head, tail)) = split_layer(s) {
        if tail == "attn.norm.weight" {
            return format!("{head}.attn.kv_norm.weight");
        }
    }
    s.to_string()
}

/// Split `layers.N.rest` / `mtp.N.rest` into (`layers.N`, `rest`).
fn split_layer(s: &str) -> Option<(&str, &str)> {
    for p in ["layers.", "mtp."] {
        if let Some(rest) = s.strip_prefix(p) {
            let dot = rest.find('.')?;
            if rest[..dot].bytes().all(|b| b.is_ascii_digit()) && dot > 0 {
                let cut = p.len() + dot;
                return Some((&s[..cut], &s[cut + 1..]));
            }
        }
    }
    None
}

/// Rename the first dotted component of `s` through `table`; None when it is not listed.
fn rename_first(s: &str, table: &[(&str, &str)]) -> Option<String> {
    let (head, rest) = match s.find('.') {
        Some(i) => (&s[..i], Some(&s[i + 1..])),
        None => (s, None),
    };
    let new = table.iter().find(|(from, _)| *from == head)?.1;
    Some(match rest {
        Some(r) => format!("{new}.{r}"),
        None => new.to_string(),
    })
}

const ATTN: &[(&str, &str)] = &[
    ("q_a_proj", "wq_a"),
    ("q_b_proj", "wq_b"),
    ("kv_proj", "wkv"),
    ("o_a_proj", "wo_a"),
    ("o_b_proj", "wo_b"),
    ("q_a_norm", "q_norm"),
    ("kv_norm", "kv_norm"),
    ("norm", "kv_norm"),
    ("kv_a_layernorm", "kv_norm"),
    ("sinks", "attn_sink"),
];
const COMPRESSOR: &[(&str, &str)] = &[
    ("kv_proj", "wkv"),
    ("gate_proj", "wgate"),
    ("kv_norm", "norm"),
    ("position_bias", "ape"),
];
const INDEXER: &[(&str, &str)] = &[
    ("q_b_proj", "indexer.wq_b"),
    ("weights_proj", "indexer.weights_proj"),
    ("kv_proj", "indexer.compressor.wkv"),
    ("gate_proj", "indexer.compressor.wgate"),
    ("kv_norm", "indexer.compressor.norm"),
    ("position_bias", "indexer.compressor.ape"),
];
const MLP: &[(&str, &str)] = &[("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")];

fn hf(raw: &str, layout: FusedLayout) -> Canon {
    if let Some(rest) = raw.strip_prefix("lm_head.") {
        return Canon::Plain(format!("head.{rest}"));
    }
    let Some(s) = raw.strip_prefix("model.") else {
        return Canon::Plain(raw.to_string());
    };
    if let Some(m) = model_level(s) {
        return Canon::Plain(m);
    }
    let Some((head, tail)) = split_layer(s) else {
        return Canon::Plain(s.to_string());
    };
    let plain = |t: String| Canon::Plain(format!("{head}.{t}"));
    if layout == FusedLayout::Interleaved {
        if let Some((leaf, part)) = tail.strip_prefix("mlp.experts.").and_then(interleaved) {
            return Canon::PerExpert {
                prefix: head.to_string(),
                leaf,
                part,
            };
        }
    }
    match tail {
        "input_layernorm.weight" => return plain("attn_norm.weight".into()),
        "post_attention_layernorm.weight" => return plain("ffn_norm.weight".into()),
        "mlp.experts.gate_up_proj" | "mlp.experts.gate_up_proj.weight" => {
            return Canon::Fused {
                prefix: head.to_string(),
                gate_up: true,
            }
        }
        "mlp.experts.down_proj" | "mlp.experts.down_proj.weight" => {
            return Canon::Fused {
                prefix: head.to_string(),
                gate_up: false,
            }
        }
        _ => {}
    }
    for (hc, off) in [("attn_hc.", "hc_attn_"), ("ffn_hc.", "hc_ffn_")] {
        if let Some(leaf) = tail.strip_prefix(hc) {
            return plain(format!("{off}{leaf}"));
        }
    }
    if let Some(a) = tail.strip_prefix("self_attn.") {
        if let Some(ix) = a.strip_prefix("compressor.indexer.") {
            let ix = ix
                .strip_prefix("scorer.")
                .filter(|r| r.starts_with("weights_proj"))
                .unwrap_or(ix);
            if let Some(r) = rename_first(ix, INDEXER) {
                return plain(format!("attn.{r}"));
            }
            return plain(format!("attn.indexer.{ix}"));
        }
        if let Some(c) = a.strip_prefix("compressor.") {
            let r = rename_first(c, COMPRESSOR).unwrap_or_else(|| c.to_string());
            return plain(format!("attn.compressor.{r}"));
        }
        let r = rename_first(a, ATTN).unwrap_or_else(|| a.to_string());
        return plain(format!("attn.{r}"));
    }
    if let Some(m) = tail.strip_prefix("mlp.") {
        // gpt-oss's router (`mlp.router`, an nn.Linear with bias) is the gate
        if let Some(g) = m.strip_prefix("router.") {
            return plain(format!("ffn.gate.{g}"));
        }
        if let Some(g) = m.strip_prefix("gate.") {
            let g = if g == "e_score_correction_bias" {
                "bias"
            } else {
                g
            };
            return plain(format!("ffn.gate.{g}"));
        }
        if let Some(se) = m.strip_prefix("shared_experts.") {
            let r = rename_first(se, MLP).unwrap_or_else(|| se.to_string());
            return plain(format!("ffn.shared_experts.{r}"));
        }
        if let Some(ex) = m.strip_prefix("experts.") {
            // llm-compressor's gpt-oss `LinearExperts`: `mlp.experts.experts.E.gate_proj…`
            let ex = ex
                .strip_prefix("experts.")
                .filter(|r| r.bytes().next().is_some_and(|b| b.is_ascii_digit()))
                .unwrap_or(ex);
            if let Some(dot) = ex.find('.') {
                if ex[..dot].bytes().all(|b| b.is_ascii_digit()) {
                    let r = rename_first(&ex[dot + 1..], MLP)
                        .unwrap_or_else(|| ex[dot + 1..].to_string());
                    return plain(format!("ffn.experts.{}.{r}", &ex[..dot]));
                }
            }
        }
        return plain(format!("ffn.{m}"));
    }
    plain(tail.to_string())
}

/// Sort key that orders `layers.10` after `layers.9`: digit runs compare as numbers.
pub fn natural_key(s: &str) -> Vec<(u8, u64, String)> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut num: Option<u64> = None;
    for ch in s.chars() {
        if let Some(d) = ch.to_digit(10) {
            if !cur.is_empty() {
                out.push((1, 0, std::mem::take(&mut cur)));
            }
            num = Some(num.unwrap_or(0).saturating_mul(10).saturating_add(d as u64));
        } else {
            if let Some(n) = num.take() {
                out.push((0, n, String::new()));
            }
            cur.push(ch);
        }
    }
    if let Some(n) = num {
        out.push((0, n, String::new()));
    }
    if !cur.is_empty() {
        out.push((1, 0, cur));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(raw: &str, n: Naming) -> String {
        match canonical(raw, n) {
            Canon::Plain(s) => s,
            other => panic!("{other:?}"),
        }
    }

    // Expected values transcribed from docs/DSV4-LAYER.md §2.2 (HF conversion_mapping rules).
    #[test]
    fn hf_names_map_to_official() {
        let h = Naming::Hf;
        assert_eq!(
            p("model.layers.3.self_attn.q_a_proj.weight", h),
            "layers.3.attn.wq_a.weight"
        );
        assert_eq!(
            p("model.layers.3.self_attn.kv_proj.weight_scale_2", h),
            "layers.3.attn.wkv.weight_scale_2"
        );
        assert_eq!(
            p("model.layers.3.self_attn.o_b_proj.input_scale", h),
            "layers.3.attn.wo_b.input_scale"
        );
        assert_eq!(
            p("model.layers.3.self_attn.q_a_norm.weight", h),
            "layers.3.attn.q_norm.weight"
        );
        assert_eq!(
            p("model.layers.3.self_attn.sinks", h),
            "layers.3.attn.attn_sink"
        );
        assert_eq!(
            p("model.layers.3.self_attn.compressor.position_bias", h),
            "layers.3.attn.compressor.ape"
        );
        assert_eq!(
            p("model.layers.3.self_attn.compressor.gate_proj.weight", h),
            "layers.3.attn.compressor.wgate.weight"
        );
        assert_eq!(
            p("model.layers.3.self_attn.compressor.kv_norm.weight", h),
            "layers.3.attn.compressor.norm.weight"
        );
        assert_eq!(
            p(
                "model.layers.2.self_attn.compressor.indexer.scorer.weights_proj.weight",
                h
            ),
            "layers.2.attn.indexer.weights_proj.weight"
        );
        assert_eq!(
            p(
                "model.layers.2.self_attn.compressor.indexer.weights_proj.weight",
                h
            ),
            "layers.2.attn.indexer.weights_proj.weight"
        );
        assert_eq!(
            p(
                "model.layers.2.self_attn.compressor.indexer.kv_norm.weight",
                h
            ),
            "layers.2.attn.indexer.compressor.norm.weight"
        );
        assert_eq!(
            p(
                "model.layers.2.self_attn.compressor.indexer.position_bias",
                h
            ),
            "layers.2.attn.indexer.compressor.ape"
        );
        assert_eq!(
            p(
                "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight",
                h
            ),
            "layers.2.attn.indexer.wq_b.weight"
        );
        assert_eq!(
            p("model.layers.0.input_layernorm.weight", h),
            "layers.0.attn_norm.weight"
        );
        assert_eq!(
            p("model.layers.0.post_attention_layernorm.weight", h),
            "layers.0.ffn_norm.weight"
        );
        assert_eq!(p("model.layers.0.attn_hc.fn", h), "layers.0.hc_attn_fn");
        assert_eq!(p("model.layers.0.ffn_hc.scale", h), "layers.0.hc_ffn_scale");
        assert_eq!(
            p("model.layers.5.mlp.gate.e_score_correction_bias", h),
            "layers.5.ffn.gate.bias"
        );
        assert_eq!(
            p("model.layers.0.mlp.gate.tid2eid", h),
            "layers.0.ffn.gate.tid2eid"
        );
        assert_eq!(
            p("model.layers.0.mlp.shared_experts.down_proj.weight", h),
            "layers.0.ffn.shared_experts.w2.weight"
        );
        assert_eq!(
            p("model.layers.0.mlp.experts.17.up_proj.weight_scale", h),
            "layers.0.ffn.experts.17.w3.weight_scale"
        );
        assert_eq!(p("model.embed_tokens.weight", h), "embed.weight");
        assert_eq!(p("model.norm.weight", h), "norm.weight");
        assert_eq!(p("lm_head.weight", h), "head.weight");
        assert_eq!(p("model.hc_head.hc_base", h), "hc_head_base");
        assert_eq!(
            canonical("model.layers.4.mlp.experts.gate_up_proj", h),
            Canon::Fused {
                prefix: "layers.4".into(),
                gate_up: true
            }
        );
    }

    /// gpt-oss's fused experts per expert, in its BF16 save_pretrained layout and in the released
    /// MXFP4 one; the stacked layout of the same names stays as it was.
    #[test]
    fn gpt_oss_experts_map_per_expert() {
        let i = |raw: &str| canonical_in(raw, Naming::Hf, FusedLayout::Interleaved);
        let pe = |leaf: &str, part| Canon::PerExpert {
            prefix: "layers.1".into(),
            leaf: leaf.into(),
            part,
        };
        assert_eq!(
            i("model.layers.1.mlp.experts.gate_up_proj"),
            pe("w13.weight", FusedPart::Transposed)
        );
        assert_eq!(
            i("model.layers.1.mlp.experts.down_proj"),
            pe("w2.weight", FusedPart::Transposed)
        );
        assert_eq!(
            i("model.layers.1.mlp.experts.gate_up_proj_bias"),
            pe("w13.bias", FusedPart::Whole)
        );
        assert_eq!(
            i("model.layers.1.mlp.experts.down_proj_blocks"),
            pe("w2.weight", FusedPart::Whole)
        );
        assert_eq!(
            i("model.layers.1.mlp.experts.gate_up_proj_scales"),
            pe("w13.weight_scale", FusedPart::Whole)
        );
        // llm-compressor's linear experts: one canonical tensor per stored one
        for (raw, c) in [
            ("gate_proj.weight_packed", "w1.weight_packed"),
            ("up_proj.bias", "w3.bias"),
            ("down_proj.input_global_scale", "w2.input_global_scale"),
        ] {
            assert_eq!(
                i(&format!("model.layers.1.mlp.experts.experts.12.{raw}")),
                Canon::Plain(format!("layers.1.ffn.experts.12.{c}"))
            );
        }
        let p = |c: Canon| match c {
            Canon::Plain(s) => s,
            other => panic!("{other:?}"),
        };
        assert_eq!(
            p(i("model.layers.1.mlp.router.bias")),
            "layers.1.ffn.gate.bias"
        );
        assert_eq!(
            p(i("model.layers.1.self_attn.q_proj.bias")),
            "layers.1.attn.q_proj.bias"
        );
        assert_eq!(
            p(i("model.layers.1.self_attn.sinks")),
            "layers.1.attn.attn_sink"
        );
        assert_eq!(
            canonical("model.layers.1.mlp.experts.gate_up_proj", Naming::Hf),
            Canon::Fused {
                prefix: "layers.1".into(),
                gate_up: true
            }
        );
    }

    #[test]
    fn hybrid_names_map_to_official() {
        let h = Naming::HfHybrid;
        assert_eq!(
            p("model.layers.1.attn.wq_a.weight", h),
            "layers.1.attn.wq_a.weight"
        );
        assert_eq!(
            p("model.layers.1.attn.norm.weight", h),
            "layers.1.attn.kv_norm.weight"
        );
        assert_eq!(
            p("model.layers.1.attn.compressor.norm.weight", h),
            "layers.1.attn.compressor.norm.weight"
        );
        assert_eq!(p("model.layers.1.hc_attn_fn", h), "layers.1.hc_attn_fn");
        assert_eq!(p("model.embed_tokens.weight", h), "embed.weight");
        assert_eq!(p("model.hc_head.hc_fn", h), "hc_head_fn");
        assert_eq!(p("head.weight", h), "head.weight");
    }

    #[test]
    fn detection() {
        assert_eq!(
            detect(["layers.0.attn.wq_a.weight", "embed.weight"]),
            Naming::Official
        );
        assert_eq!(
            detect(["model.layers.0.attn.wq_a.weight", "head.weight"]),
            Naming::HfHybrid
        );
        assert_eq!(
            detect([
                "model.embed_tokens.weight",
                "model.layers.0.self_attn.q_a_proj.weight"
            ]),
            Naming::Hf
        );
    }

    #[test]
    fn natural_order() {
        let mut v = vec!["layers.10.a", "layers.9.a", "layers.1.b"];
        v.sort_by_key(|s| natural_key(s));
        assert_eq!(v, ["layers.1.b", "layers.9.a", "layers.10.a"]);
    }
}
