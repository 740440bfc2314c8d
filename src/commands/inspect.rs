//! `inspect`: the weights of a checkpoint, their schemes, scales and health.
//!
//! Reads headers, scalar scales and block-scale bytes only — never packed weights — so a full
//! 256-expert layer is described in well under a second. `--dequant` is the one exception: it
//! reads the single weight it is asked for.

use std::path::{Path, PathBuf};

use comfy_table::{ContentArrangement, Table};
use rayon::prelude::*;
use serde::Serialize;

use crate::checkpoint::quant::{amax_from_scales, implied_amax};
use crate::checkpoint::writer::{serialize, write_file};
use crate::checkpoint::{Checkpoint, Dtype, ScaleKind, ScaleSummary, WeightMeta};
use crate::cli::InspectArgs;
use crate::numerics::nvfp4::Convention;
use crate::{Error, Result};

/// JSON schema tag of `--json`.
pub const SCHEMA: &str = "nvfp4-probe.inspect/1";

/// One weight as `inspect` reports it.
#[derive(Clone, Debug, Serialize)]
pub struct InspectRow {
    pub canonical: String,
    pub raw: String,
    pub scheme: &'static str,
    /// "ct" | "modelopt" for NVFP4, else null.
    pub convention: Option<&'static str>,
    pub shape: [usize; 2],
    pub dtype: String,
    pub file: PathBuf,
    /// As stored: CT g_w or ModelOpt d_w.
    pub weight_global_scale: Option<f32>,
    /// 2688/g (CT) or 2688·d (ModelOpt).
    pub weight_amax_implied: Option<f32>,
    /// As stored: CT g_x or ModelOpt d_x; null when the checkpoint has none.
    pub input_global_scale: Option<f32>,
    pub input_amax_implied: Option<f32>,
    pub block_scale: Option<ScaleSummary>,
    /// Max block scale × max element × tensor scale: the largest value the weight can decode to.
    pub weight_amax_from_scales: Option<f32>,
}

#[derive(Serialize)]
struct InspectJson<'a> {
    schema: &'static str,
    model: &'a Path,
    naming: &'static str,
    weights: &'a [InspectRow],
}

fn conv_label(c: Convention) -> &'static str {
    match c {
        Convention::CompressedTensors => "ct",
        Convention::ModelOpt => "modelopt",
    }
}

/// Describe one weight from its meta and scale bytes.
pub fn row(ck: &Checkpoint, m: &WeightMeta) -> Result<InspectRow> {
    let summary = ck.scale_summary(m)?;
    let implied = |v: Option<f32>| Some(implied_amax(m.convention?, v?));
    Ok(InspectRow {
        canonical: m.canonical.clone(),
        raw: m.tensors.weight.clone(),
        scheme: m.scheme_label(),
        convention: m.convention.map(conv_label),
        shape: [m.out_features, m.in_features],
        dtype: format!("{:?}", m.weight_dtype),
        file: m.file.clone(),
        weight_global_scale: m.weight_global,
        weight_amax_implied: implied(m.weight_global),
        input_global_scale: m.input_global,
        input_amax_implied: implied(m.input_global),
        weight_amax_from_scales: summary.as_ref().and_then(|s| amax_from_scales(m, s)),
        block_scale: summary,
    })
}

/// Rows for every linear weight of the checkpoint, in natural order.
pub fn rows(ck: &Checkpoint) -> Result<Vec<InspectRow>> {
    ck.weight_bases()
        .par_iter()
        .map(|b| ck.weight_meta(b).and_then(|m| row(ck, &m)))
        .collect()
}

fn num(x: f32) -> String {
    let a = x.abs();
    if x.is_nan() || x.is_infinite() || x == 0.0 || (1e-3..1e6).contains(&a) {
        format!("{x}")
    } else {
        format!("{x:.6e}")
    }
}

fn pct(f: f64) -> String {
    if f == 0.0 {
        "0".into()
    } else {
        format!("{:.2}%", f * 100.0)
    }
}

fn scale_cell(s: &Option<ScaleSummary>) -> String {
    match s {
        None => "-".into(),
        Some(s) => match s.kind {
            ScaleKind::E4m3 => format!(
                "0x00 {} · 0x7E {} · NaN {}",
                pct(s.frac_zero),
                pct(s.frac_7e),
                pct(s.frac_nan)
            ),
            ScaleKind::Ue8m0 => format!("0x00 {} · 0xFF {}", pct(s.frac_zero), pct(s.frac_ff)),
            ScaleKind::F32 => format!("zero {} · NaN {}", pct(s.frac_zero), pct(s.frac_nan)),
        },
    }
}

fn global_cell(stored: Option<f32>, implied: Option<f32>) -> String {
    match (stored, implied) {
        (Some(s), Some(a)) => format!("{} (amax {})", num(s), num(a)),
        (Some(s), None) => num(s),
        _ => "-".into(),
    }
}

pub fn render_table(rows: &[InspectRow]) -> String {
    let mut t = Table::new();
    t.set_content_arrangement(ContentArrangement::Disabled);
    t.set_header([
        "weight",
        "raw name",
        "scheme",
        "conv",
        "shape",
        "weight scale (→ amax)",
        "input scale (→ amax)",
        "block scales",
        "amax from scales",
    ]);
    for r in rows {
        t.add_row([
            r.canonical.clone(),
            r.raw.clone(),
            r.scheme.to_string(),
            r.convention.unwrap_or("-").to_string(),
            format!("{}×{}", r.shape[0], r.shape[1]),
            global_cell(r.weight_global_scale, r.weight_amax_implied),
            global_cell(r.input_global_scale, r.input_amax_implied),
            scale_cell(&r.block_scale),
            r.weight_amax_from_scales
                .map(num)
                .unwrap_or_else(|| "-".into()),
        ]);
    }
    t.to_string()
}

/// Map a user-given name (canonical base, canonical tensor, or raw tensor) to a canonical base.
fn find_base(ck: &Checkpoint, name: &str) -> Option<String> {
    let strip = |s: &str| -> String {
        for suf in [".weight_packed", ".weight"] {
            if let Some(b) = s.strip_suffix(suf) {
                return b.to_string();
            }
        }
        s.to_string()
    };
    let bases = ck.weight_bases();
    let has = |b: &str| bases.iter().any(|x| x == b);
    if has(name) {
        return Some(name.to_string());
    }
    let b = strip(name);
    if has(&b) {
        return Some(b);
    }
    let b = strip(ck.canonical_of(name)?);
    has(&b).then_some(b)
}

/// Refuse outputs that would land inside the model directory: the tool never writes there.
fn check_out(model: &Path, out: &Path) -> Result<()> {
    let model_c = std::fs::canonicalize(model).map_err(|e| Error::io(model, e))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let parent_c = std::fs::canonicalize(&parent).map_err(|e| Error::io(&parent, e))?;
    if parent_c.starts_with(&model_c) {
        return Err(Error::usage(format!(
            "refusing to write {} inside the model directory {}",
            out.display(),
            model.display()
        )));
    }
    if out.is_dir() {
        return Err(Error::usage(format!(
            "--out {} is a directory",
            out.display()
        )));
    }
    Ok(())
}

fn dequant(ck: &Checkpoint, args: &InspectArgs, name: &str) -> Result<i32> {
    let out = args
        .out
        .as_ref()
        .ok_or_else(|| Error::usage("--dequant needs --out FILE.safetensors"))?;
    check_out(&args.model, out)?;
    let base = find_base(ck, name).ok_or_else(|| Error::MissingTensor {
        dir: ck.location().to_path_buf(),
        tensor: name.to_string(),
        hint: "not a linear weight of this checkpoint (give a canonical base like `layers.0.attn.wq_a` or a raw weight name)".into(),
    })?;
    let w = ck.weight(&base)?;
    let t = w.dequantize()?;
    let bytes: Vec<u8> = t.data.iter().flat_map(|x| x.to_le_bytes()).collect();
    let tname = format!("{base}.weight");
    let buf = serialize(&[(tname.as_str(), Dtype::F32, &t.shape, &bytes)], None)?;
    write_file(out, &buf)?;
    println!(
        "wrote {tname} [{}, {}] ({}) as F32 to {}",
        t.shape[0],
        t.shape[1],
        w.scheme(),
        out.display()
    );
    Ok(crate::error::EXIT_OK)
}

pub fn main(args: &InspectArgs) -> Result<i32> {
    let ck = Checkpoint::open(&args.model)?;
    if let Some(name) = &args.dequant {
        return dequant(&ck, args, name);
    }
    let rows = rows(&ck)?;
    crate::lint::warn_incomplete(&ck);
    if let Some(j) = &args.json {
        if let Some(parent) = j.parent().filter(|p| !p.as_os_str().is_empty()) {
            let (pc, mc) = (
                std::fs::canonicalize(parent),
                std::fs::canonicalize(&args.model),
            );
            if let (Ok(pc), Ok(mc)) = (pc, mc) {
                if pc.starts_with(&mc) {
                    return Err(Error::usage(format!(
                        "refusing to write {} inside the model directory",
                        j.display()
                    )));
                }
            }
        }
        let doc = InspectJson {
            schema: SCHEMA,
            model: ck.location(),
            naming: ck.naming().as_str(),
            weights: &rows,
        };
        let text =
            serde_json::to_string_pretty(&doc).map_err(|e| Error::bad(j, None, e.to_string()))?;
        write_file(j, text.as_bytes())?;
    }
    println!(
        "{}: {} weights, {} naming",
        ck.location().display(),
        rows.len(),
        ck.naming().as_str()
    );
    println!("{}", render_table(&rows));
    Ok(crate::error::EXIT_OK)
}
