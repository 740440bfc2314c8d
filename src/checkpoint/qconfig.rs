//! What the quantization config declares (`quantization_config` of config.json, else
//! `hf_quant_config.json`'s `quantization`, which only ModelOpt writes), resolved once for lint's
//! rule `config.scheme` and for `run`, which refuses what this cannot resolve: a declaration the
//! tool does not know (compressed-tensors `float-quantized` or `pack-quantized`, ModelOpt
//! `quant_algo: FP8` or `W4A8_AWQ`, `quant_method: gptq`, …) would otherwise skip the check of
//! the tensors against it and be reported clean.

use std::collections::BTreeMap;
use std::path::PathBuf;

use serde_json::Value;

use super::formats::TABLE;
use super::{Checkpoint, Scheme};
use crate::Error;

/// A quantization config resolved against the format table.
#[derive(Clone, Debug, PartialEq)]
pub enum Declared {
    /// No quantization config: every weight is expected unquantized.
    None,
    /// One scheme for every weight outside the ignore list: compressed-tensors (`format`),
    /// ModelOpt (`quant_algo`), gpt-oss's `quant_method: mxfp4`.
    Uniform {
        method: String,
        scheme: Scheme,
        /// The config's key of the unquantized modules (`ignore`, `exclude_modules`, …).
        ignore_key: &'static str,
        ignore: Vec<String>,
    },
    /// DeepSeek's `quant_method: fp8` (block FP8; NVFP4 or MXFP4 routed experts where
    /// `moe_quant_algo` / `expert_dtype` say so).
    Fp8 { ignore: Vec<String> },
    /// ModelOpt's `quant_algo: MIXED_PRECISION`: each quantized module's scheme from
    /// `quantized_layers` (raw module name → scheme); a module not listed is unquantized.
    Mixed {
        layers: BTreeMap<String, Scheme>,
        ignore: Vec<String>,
    },
}

/// Why a quantization config cannot be resolved: the file, the field, what is wrong with it.
#[derive(Clone, Debug, PartialEq)]
pub struct Undeclared {
    pub file: PathBuf,
    pub field: String,
    pub msg: String,
}

impl Undeclared {
    pub fn to_error(&self) -> Error {
        Error::bad(&self.file, None, format!("`{}`: {}", self.field, self.msg))
    }
}

fn str_list(v: Option<&Value>) -> Vec<String> {
    v.and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .filter_map(|e| e.as_str().map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Names the table knows for a compressed-tensors `format` (substrings) and a ModelOpt `quant_algo`.
fn ct_known() -> String {
    let v: Vec<&str> = TABLE.iter().filter_map(|s| s.config.ct_format).collect();
    format!("a format naming {}", v.join(", "))
}

fn algo_known() -> String {
    let mut v: Vec<&str> = TABLE
        .iter()
        .filter_map(|s| s.config.modelopt_algo)
        .collect();
    v.push("MIXED_PRECISION");
    v.join(", ")
}

fn ct_scheme(fmt: &str) -> Option<Scheme> {
    TABLE
        .iter()
        .find(|s| s.config.ct_format.is_some_and(|f| fmt.contains(f)))
        .map(|s| s.scheme)
}

fn algo_scheme(algo: &str) -> Option<Scheme> {
    TABLE
        .iter()
        .find(|s| s.config.modelopt_algo == Some(algo))
        .map(|s| s.scheme)
}

impl Checkpoint {
    /// The quantization config resolved ([`Declared`]), or why it cannot be (a method, format or
    /// algorithm this tool does not read, a field of the wrong type): the tensors cannot be
    /// checked against such a config, so lint reports it (`config.scheme`) and `run` refuses it.
    pub fn quant_declared(&self) -> std::result::Result<Declared, Undeclared> {
        let in_config = self
            .config
            .get("quantization_config")
            .filter(|v| !v.is_null());
        let (q, prefix, file) = match (in_config, &self.hf_quant) {
            (Some(q), _) => (q, "quantization_config", self.config_path.clone()),
            (None, Some(h)) => match h.get("quantization").filter(|v| !v.is_null()) {
                Some(q) => (
                    q,
                    "quantization",
                    self.location.join("hf_quant_config.json"),
                ),
                None => return Ok(Declared::None),
            },
            (None, None) => return Ok(Declared::None),
        };
        let bad = |field: &str, msg: String| Undeclared {
            file: file.clone(),
            field: format!("{prefix}{}{field}", if field.is_empty() { "" } else { "." }),
            msg,
        };
        if !q.is_object() {
            return Err(bad("", format!("is not an object: {q}")));
        }
        let from_hf = prefix == "quantization";
        // hf_quant_config.json carries no quant_method: only ModelOpt writes that file
        let method = match q.get("quant_method").filter(|v| !v.is_null()) {
            Some(Value::String(s)) => s.clone(),
            Some(other) => return Err(bad("quant_method", format!("is not a string: {other}"))),
            None if from_hf => "modelopt".to_string(),
            None => {
                return Err(bad(
                    "quant_method",
                    "is missing: the producer of the tensors is not declared".into(),
                ))
            }
        };
        let hq = self.hf_quant.as_ref().and_then(|h| h.get("quantization"));
        match method.as_str() {
            "compressed-tensors" => {
                // the top-level format, else (or `mixed-precision`) each group's, all one scheme
                let mut formats: Vec<(String, &Value)> = Vec::new();
                if let Some(f) = q.get("format").filter(|v| !v.is_null()) {
                    if f.as_str() != Some("mixed-precision") {
                        formats.push(("format".into(), f));
                    }
                }
                if let Some(g) = q.get("config_groups").filter(|v| !v.is_null()) {
                    let g = g.as_object().ok_or_else(|| {
                        bad("config_groups", format!("is not an object: {g}"))
                    })?;
                    for (name, grp) in g {
                        if let Some(f) = grp.get("format").filter(|v| !v.is_null()) {
                            formats.push((format!("config_groups.{name}.format"), f));
                        }
                    }
                }
                if formats.is_empty() {
                    return Err(bad(
                        "format",
                        format!("is missing (and no config group names one): expected {}", ct_known()),
                    ));
                }
                let mut scheme: Option<(String, Scheme)> = None;
                for (field, f) in formats {
                    let s = f
                        .as_str()
                        .ok_or_else(|| bad(&field, format!("is not a string: {f}")))?;
                    let sc = ct_scheme(s).ok_or_else(|| {
                        bad(
                            &field,
                            format!("`{s}` is not a compressed-tensors format this tool reads (expected {}): the tensors cannot be checked against it", ct_known()),
                        )
                    })?;
                    match &scheme {
                        Some((f0, s0)) if *s0 != sc => {
                            return Err(bad(
                                &field,
                                format!("`{s}` declares another scheme than `{f0}`: groups of different schemes are not read by this tool"),
                            ))
                        }
                        Some(_) => {}
                        None => scheme = Some((field, sc)),
                    }
                }
                Ok(Declared::Uniform {
                    method,
                    scheme: scheme.expect("one format at least").1,
                    ignore_key: "ignore",
                    ignore: str_list(q.get("ignore")),
                })
            }
            "modelopt" => {
                let mut ignore = str_list(q.get("exclude_modules"));
                if ignore.is_empty() {
                    ignore = str_list(hq.and_then(|h| h.get("exclude_modules")));
                }
                let algo = match q.get("quant_algo").filter(|v| !v.is_null()) {
                    Some(Value::String(s)) => s.clone(),
                    Some(other) => {
                        return Err(bad("quant_algo", format!("is not a string: {other}")))
                    }
                    None => String::new(),
                };
                if algo == "MIXED_PRECISION" {
                    let listed = q
                        .get("quantized_layers")
                        .or_else(|| hq.and_then(|h| h.get("quantized_layers")))
                        .and_then(Value::as_object)
                        .ok_or_else(|| {
                            bad(
                                "quant_algo",
                                "is `MIXED_PRECISION` but no `quantized_layers` says which scheme each layer has".into(),
                            )
                        })?;
                    let mut layers = BTreeMap::new();
                    for (module, e) in listed {
                        let a = e.get("quant_algo").and_then(Value::as_str).unwrap_or("");
                        let s = algo_scheme(a).ok_or_else(|| {
                            bad(
                                &format!("quantized_layers.{module}.quant_algo"),
                                format!("`{a}` is not a ModelOpt algorithm this tool reads (expected {})", algo_known()),
                            )
                        })?;
                        layers.insert(module.clone(), s);
                    }
                    return Ok(Declared::Mixed { layers, ignore });
                }
                let scheme = algo_scheme(&algo).ok_or_else(|| {
                    bad(
                        "quant_algo",
                        format!("`{algo}` is not a ModelOpt algorithm this tool reads (expected {}): the tensors cannot be checked against it", algo_known()),
                    )
                })?;
                Ok(Declared::Uniform {
                    method,
                    scheme,
                    ignore_key: "exclude_modules",
                    ignore,
                })
            }
            // gpt-oss's release: MXFP4 experts, `modules_to_not_convert` the rest
            "mxfp4" => Ok(Declared::Uniform {
                method,
                scheme: Scheme::Mxfp4,
                ignore_key: "modules_to_not_convert",
                ignore: str_list(q.get("modules_to_not_convert")),
            }),
            "fp8" => {
                match q.get("moe_quant_algo").filter(|v| !v.is_null()) {
                    None => {}
                    Some(Value::String(s)) if s == "NVFP4" => {}
                    Some(other) => {
                        return Err(bad(
                            "moe_quant_algo",
                            format!("{other} is not an expert scheme this tool reads (NVFP4, or none)"),
                        ))
                    }
                }
                let mut ignore = str_list(q.get("ignore"));
                if ignore.is_empty() {
                    ignore = str_list(q.get("exclude_modules"));
                }
                Ok(Declared::Fp8 { ignore })
            }
            other => Err(bad(
                "quant_method",
                format!("`{other}` is not a quantization method this tool reads (compressed-tensors, modelopt, mxfp4, fp8): the tensors cannot be checked against it"),
            )),
        }
    }

    /// [`Checkpoint::quant_declared`] as a refusal (exit 2) naming the file and the field.
    pub fn check_quant_declared(&self) -> crate::Result<()> {
        self.quant_declared().map(|_| ()).map_err(|u| u.to_error())
    }
}
