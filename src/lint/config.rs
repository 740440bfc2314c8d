//! Rule 8: what `quantization_config` (or `hf_quant_config.json`) claims against what the
//! tensors are. Engines build their modules from the config, so a claim the tensors do not back
//! is a load failure at best and a silent mis-read at worst.
//!
//! The list of unquantized modules is compressed-tensors' `ignore`, ModelOpt's
//! `exclude_modules`, or gpt-oss's `modules_to_not_convert` (`quant_method: mxfp4`), whose
//! entries name modules: an entry covers every tensor under the module (transformers and vLLM
//! match them as prefixes), so `model.layers.*.self_attn` covers `…self_attn.q_proj`.

use std::collections::HashSet;

use super::checks::raw_stem;
use super::rules::Severity::{Error as E, Info as I, Warning as W};
use super::{Cx, Finding};
use crate::checkpoint::formats::InFp8;
use crate::checkpoint::qconfig::Declared;
use crate::checkpoint::{Scheme, WeightMeta};

/// One ignore/exclude entry, compiled once: `re:` entries are Python `re.match` patterns
/// (anchored at the start; compiled by the `regex` crate, whose matching time is linear, so a
/// hostile config cannot hang `lint`); other entries are fnmatch globs (`*`, `?`) or exact names.
pub enum Entry {
    Glob(String),
    Re(regex::Regex),
    /// A `re:` pattern the `regex` crate does not accept (look-around, back-references).
    Unsupported,
}

impl Entry {
    pub fn new(entry: &str) -> Entry {
        match entry.strip_prefix("re:") {
            Some(re) => regex::Regex::new(&format!("^(?:{re})"))
                .map(Entry::Re)
                .unwrap_or(Entry::Unsupported),
            None => Entry::Glob(entry.to_string()),
        }
    }

    /// Does the entry match a module name? None for an unsupported pattern.
    pub fn matches(&self, name: &str) -> Option<bool> {
        match self {
            Entry::Glob(g) => Some(crate::glob::glob_match(g, name)),
            Entry::Re(r) => Some(r.is_match(name)),
            Entry::Unsupported => None,
        }
    }
}

/// [`Entry::new`] then [`Entry::matches`].
#[cfg(test)]
fn matches(entry: &str, name: &str) -> Option<bool> {
    Entry::new(entry).matches(name)
}

/// The proper dotted prefixes of a name: `a.b.c` → `a`, `a.b`.
fn dotted_prefixes(name: &str) -> Vec<String> {
    name.match_indices('.')
        .map(|(i, _)| name[..i].to_string())
        .collect()
}

fn is_expert(base: &str) -> bool {
    base.contains(".ffn.experts.")
}

pub(crate) fn check_config(cx: &Cx, metas: &[WeightMeta]) -> Vec<Finding> {
    let mut out = Vec::new();
    let cfg_file = cx.ck.config_path().to_path_buf();
    let quantized: Vec<&WeightMeta> = metas.iter().filter(|m| m.scheme != Scheme::Dense).collect();
    let declared = match cx.ck.quant_declared() {
        Ok(d) => d,
        Err(u) => {
            // a declaration the tensors cannot be checked against: never reported clean
            out.extend(cx.finding(
                "config.scheme",
                E,
                &u.field,
                &u.file,
                "",
                format!("`{}` in {}: {}", u.field, u.file.display(), u.msg),
                "Write the quantization config of the producer that made the tensors (a scheme this tool reads: docs/NVFP4.md §3.4), or convert the tensors; `run` refuses the checkpoint until then.",
            ));
            return out;
        }
    };
    let q = cx.ck.quantization_config().cloned().unwrap_or_default();
    let hq = cx.ck.hf_quant_config().and_then(|h| h.get("quantization"));
    // (scheme every non-ignored weight must have, ignore entries, what "ignored" means)
    let (expected, ignore, label, method): (Option<Scheme>, Vec<String>, &str, &str) =
        match &declared {
            Declared::None => {
                if let Some(m) = quantized.first() {
                    let mut schemes: Vec<&str> =
                        quantized.iter().map(|m| m.scheme_label()).collect();
                    schemes.sort();
                    schemes.dedup();
                    out.extend(cx.finding(
                        "config.scheme",
                        E,
                        &m.tensors.weight,
                        &cfg_file,
                        &m.canonical,
                        format!("config.json declares no quantization_config, but {} weights are quantized ({})", quantized.len(), schemes.join(", ")),
                        "Add the quantization_config of the producer that wrote the tensors; engines load them as BF16 otherwise.",
                    ));
                }
                return out;
            }
            Declared::Uniform {
                method,
                scheme,
                ignore_key,
                ignore,
            } => (Some(*scheme), ignore.clone(), *ignore_key, method.as_str()),
            Declared::Fp8 { ignore } => (None, ignore.clone(), "ignore", "fp8"),
            Declared::Mixed { ignore, .. } => (None, ignore.clone(), "exclude_modules", "mixed"),
        };
    let mixed_layers = match &declared {
        Declared::Mixed { layers, .. } => Some(layers),
        _ => None,
    };
    // module entries cover what lies under the module: every dotted prefix of the name is matched
    let prefixes = method == "mxfp4";
    let names = |m: &WeightMeta| {
        let mut v = vec![raw_stem(m), m.canonical.clone()];
        if prefixes {
            v.extend(dotted_prefixes(&raw_stem(m)));
        }
        v
    };
    let mut used: HashSet<usize> = HashSet::new();
    let mut unsupported: HashSet<usize> = HashSet::new();
    let compiled: Vec<Entry> = ignore.iter().map(|e| Entry::new(e)).collect();
    let mut ignored = |m: &WeightMeta| -> bool {
        let mut hit = false;
        for (k, e) in compiled.iter().enumerate() {
            for n in names(m) {
                match e.matches(&n) {
                    Some(true) => {
                        used.insert(k);
                        hit = true;
                    }
                    Some(false) => {}
                    None => {
                        unsupported.insert(k);
                    }
                }
            }
        }
        hit
    };
    let moe_nvfp4 = q.get("moe_quant_algo").and_then(|v| v.as_str()) == Some("NVFP4");
    let fp4_experts = q.get("expert_dtype").and_then(|v| v.as_str()) == Some("fp4")
        || cx
            .ck
            .config_json()
            .get("expert_dtype")
            .and_then(|v| v.as_str())
            == Some("fp4");
    let listed: Option<HashSet<String>> = hq
        .and_then(|h| h.get("quantized_layers"))
        .and_then(|l| l.as_object())
        .map(|o| o.keys().cloned().collect());
    for m in metas {
        let ign = ignored(m);
        let stem = raw_stem(m);
        let label_s = m.scheme_label();
        let mut emit = |rule: &str, ev: String, fix: &str| {
            out.extend(cx.finding(rule, E, &m.tensors.weight, &m.file, &m.canonical, ev, fix));
        };
        match method {
            "mixed" => {
                // ModelOpt MIXED_PRECISION: the scheme quantized_layers gives the module
                let listed = mixed_layers.and_then(|l| l.get(&stem));
                match listed {
                    Some(&exp) if m.scheme != exp => emit("config.scheme", format!("quantization_config (modelopt, MIXED_PRECISION) lists `{stem}` as {}, its tensors are {label_s}", exp.label(m.weight_dtype)), "Regenerate quantized_layers from the exported tensors (or re-export the weight)."),
                    Some(_) => {}
                    None if m.scheme != Scheme::Dense && !ign => emit("config.scheme", format!("`{stem}` is stored {label_s} but quantized_layers (modelopt, MIXED_PRECISION) does not list it: an engine builds it as an unquantized layer"), "Regenerate quantized_layers from the exported tensors."),
                    None => {}
                }
            }
            "compressed-tensors" | "modelopt" | "mxfp4" => {
                let Some(exp) = expected else { continue };
                let exp_l = exp.label(m.weight_dtype);
                if ign && m.scheme != Scheme::Dense {
                    emit("config.ignore", format!("`{stem}` matches quantization_config.{label} but is stored {label_s}: an engine builds it as an unquantized layer"), "Remove the entry from the ignore list, or store the weight unquantized.");
                } else if !ign && m.scheme == Scheme::Dense {
                    emit("config.ignore", format!("`{stem}` is stored {label_s} but not in quantization_config.{label}: an engine expects {exp_l} tensors for it"), "Add the module to the ignore list (in the checkpoint's own naming), or quantize it.");
                } else if !ign && m.scheme != exp {
                    emit("config.scheme", format!("quantization_config ({method}) implies {exp_l}, the tensors of `{stem}` are {label_s}"), "Write the config of the producer that made the tensors (or convert the tensors, docs/NVFP4.md §3.4).");
                }
            }
            _ => {
                // fp8 (DeepSeek style), optionally with NVFP4 or MXFP4 experts.
                let in_fp8 = m.scheme.spec().config.in_fp8;
                let ok = match in_fp8 {
                    InFp8::Always => true,
                    InFp8::MoeNvfp4Experts => moe_nvfp4 && is_expert(&m.canonical),
                    InFp8::Fp4Experts => fp4_experts && is_expert(&m.canonical),
                    InFp8::Never => false,
                };
                if !ok {
                    emit("config.scheme", format!("quantization_config (fp8{}) does not provide for {label_s} `{stem}`", if moe_nvfp4 { ", moe_quant_algo NVFP4" } else { "" }), "Declare the scheme (moe_quant_algo / expert_dtype / a quantization config of the producer) or re-export the weight.");
                    continue;
                }
                let nv = in_fp8 == InFp8::MoeNvfp4Experts;
                if ign && nv {
                    emit("config.ignore", format!("`{stem}` matches quantization_config.{label} but is stored {label_s}"), "Remove the entry from the ignore list, or re-export the weight in FP8/BF16.");
                } else if moe_nvfp4 && is_expert(&m.canonical) && !ign && !nv {
                    emit(
                        "config.scheme",
                        format!("moe_quant_algo is NVFP4 but expert `{stem}` is {label_s}"),
                        "Re-export the expert as NVFP4 or fix moe_quant_algo.",
                    );
                }
                if let Some(l) = &listed {
                    if nv != l.contains(&stem) {
                        emit("config.scheme", format!("hf_quant_config.json quantized_layers {} `{stem}`, whose tensors are {label_s}", if nv { "omits" } else { "lists as NVFP4" }), "Regenerate hf_quant_config.json from the exported tensors.");
                    }
                }
            }
        }
    }
    {
        // an entry may name a module that is not a linear (the embedding, a norm; releases list
        // `model.embed_tokens` and `lm_head`): used when it covers any stored tensor, in every
        // producer's config
        let raw = cx.ck.tensor_names();
        for (k, e) in compiled.iter().enumerate() {
            if raw.iter().any(|n| {
                dotted_prefixes(n)
                    .iter()
                    .any(|p| e.matches(p) == Some(true))
            }) {
                used.insert(k);
            }
        }
    }
    for (k, e) in ignore.iter().enumerate() {
        if used.contains(&k) {
            continue;
        }
        let (ev, fix) = if unsupported.contains(&k) {
            continue; // a regex lint cannot evaluate: say nothing rather than something wrong
        } else {
            (
                format!("quantization_config.{label} entry `{e}` matches no module of the checkpoint (naming {})", cx.ck.naming().as_str()),
                "Write ignore entries in the checkpoint's own module naming; a stale entry usually means another entry is missing.",
            )
        };
        // An exact name that matches nothing is a mistake; a pattern may legitimately cover
        // modules this model does not have (`mtp.*` in a model without MTP).
        let sev = if e.contains('*') || e.starts_with("re:") {
            I
        } else {
            W
        };
        out.extend(cx.finding("config.ignore", sev, e, &cfg_file, "", ev, fix));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{dotted_prefixes, matches};

    #[test]
    fn module_entries_cover_their_prefixes() {
        assert_eq!(
            dotted_prefixes("model.layers.1.self_attn.q_proj"),
            [
                "model",
                "model.layers",
                "model.layers.1",
                "model.layers.1.self_attn"
            ]
        );
        let covered = |e: &str, n: &str| {
            dotted_prefixes(n)
                .iter()
                .any(|p| matches(e, p) == Some(true))
        };
        assert!(covered(
            "model.layers.*.self_attn",
            "model.layers.12.self_attn.q_proj"
        ));
        assert!(!covered(
            "model.layers.*.self_attn",
            "model.layers.12.mlp.router"
        ));
        assert!(covered("model.embed_tokens", "model.embed_tokens.weight"));
    }

    #[test]
    fn globs_and_regexes() {
        assert_eq!(matches("*.attn.*", "layers.3.attn.wq_a"), Some(true));
        assert_eq!(matches("*.attn.*", "layers.3.ffn.gate"), Some(false));
        assert_eq!(matches("head", "head"), Some(true));
        assert_eq!(matches("head", "lm_head"), Some(false));
        assert_eq!(matches("re:.*lm_head", "lm_head"), Some(true));
        assert_eq!(
            matches("re:.*mlp\\.gate$", "model.layers.1.mlp.gate"),
            Some(true)
        );
        assert_eq!(
            matches("re:.*mlp\\.gate$", "model.layers.1.mlp.gate_proj"),
            Some(false)
        );
        assert_eq!(
            matches(
                "re:model\\.layers\\.\\d+\\.self_attn\\.o_a_proj",
                "model.layers.12.self_attn.o_a_proj"
            ),
            Some(true)
        );
        assert_eq!(matches("re:^mtp.*|.*head", "lm_head"), Some(true));
        assert_eq!(matches("re:(a|b)", "a"), Some(true));
        assert_eq!(
            matches("re:(?=a)a", "a"),
            None,
            "look-ahead is not supported"
        );
        // Python's re.match anchors at the start only
        assert_eq!(matches("re:attn", "layers.1.attn.wkv"), Some(false));
        assert_eq!(matches("re:layers", "layers.1.attn.wkv"), Some(true));
        assert_eq!(
            matches("re:layers\\.[0-2]\\.attn", "layers.1.attn.wkv"),
            Some(true)
        );
        assert_eq!(
            matches("re:layers\\.[0-2]\\.attn", "layers.5.attn.wkv"),
            Some(false)
        );
    }
}

#[cfg(test)]
mod hostile {
    use super::matches;

    /// A pattern that makes a backtracking matcher take exponential time answers at once.
    #[test]
    fn catastrophic_patterns_answer_at_once() {
        let name = "a".repeat(5_000) + "!";
        let t0 = std::time::Instant::now();
        assert_eq!(
            matches(&format!("re:{}b", "(a*)*".repeat(8)), &name),
            Some(false)
        );
        assert_eq!(
            matches(&format!("re:{}b", ".*".repeat(30)), &name),
            Some(false)
        );
        assert_eq!(matches(&("*a".repeat(30) + "b"), &name), Some(false));
        assert!(t0.elapsed().as_secs_f64() < 2.0, "{:?}", t0.elapsed());
    }
}
