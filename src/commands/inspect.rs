//! `inspect`: the weights of a checkpoint, their schemes, scales and health.
//!
//! Reads headers, scalar scales and block-scale bytes only — never packed weights — so a full
//! 256-expert layer is described in well under a second. `--dequant` is the one exception: it
//! reads the single weight it is asked for.

use std::path::{Path, PathBuf};

use rayon::prelude::*;
use serde::Serialize;

use crate::checkpoint::quant::{amax_from_scales, implied_amax};
use crate::checkpoint::writer::serialize;
use crate::checkpoint::GuardCheckpoint;
use crate::checkpoint::{Checkpoint, Dtype, ScaleKind, ScaleSummary, WeightMeta};
use crate::cli::InspectArgs;
use crate::numerics::nvfp4::Convention;
use crate::output::{Guard, Outputs};
use crate::probe::spec::glob_match;
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

/// Rows for every linear weight of the checkpoint, in layer order (see [`order_key`]).
pub fn rows(ck: &Checkpoint) -> Result<Vec<InspectRow>> {
    let mut bases = ck.weight_bases();
    bases.sort_by_cached_key(|b| order_key(b));
    bases
        .par_iter()
        // a shape that contradicts the config is warned about (`lint::warn_incomplete`), not
        // a reason to describe nothing
        .map(|b| ck.weight_meta_unchecked(b).and_then(|m| row(ck, &m)))
        .collect()
}

/// Where a weight sorts: the embedding first, then layer by layer in numeric order (attention,
/// then the FFN; experts by number), then the rest (head). Numbers compare as numbers, so
/// `layers.10` follows `layers.9` and `experts.12` follows `experts.3`.
pub fn order_key(name: &str) -> (u8, Vec<Result<u64, String>>) {
    let rank = if name.starts_with("embed") {
        0
    } else if name.starts_with("layers.") || name.starts_with("mtp.") {
        1
    } else {
        2
    };
    let parts = name
        .split('.')
        .map(|p| p.parse::<u64>().map_err(|_| p.to_string()))
        .collect();
    (rank, parts)
}

/// The layer a weight belongs to, for the summary (`L3`), or its first name component (`head`).
fn layer_of(name: &str) -> String {
    let mut it = name.split('.');
    match (it.next(), it.next().and_then(|n| n.parse::<u64>().ok())) {
        (Some("layers"), Some(n)) => format!("L{n}"),
        (Some("mtp"), Some(n)) => format!("mtp{n}"),
        (Some(first), _) => first.to_string(),
        _ => name.to_string(),
    }
}

/// `lo–hi` of finite values (or `-` when none).
fn range_cell(v: impl Iterator<Item = f32>) -> String {
    let (mut lo, mut hi) = (f32::INFINITY, f32::NEG_INFINITY);
    let mut non_finite = 0;
    for x in v {
        if x.is_finite() {
            lo = lo.min(x);
            hi = hi.max(x);
        } else {
            non_finite += 1;
        }
    }
    let short = |x: f32| {
        if (1e-3..1e4).contains(&x.abs()) {
            format!("{}", (x as f64 * 1e4).round() / 1e4)
        } else {
            format!("{x:.3e}")
        }
    };
    let mut s = if lo > hi {
        "-".to_string()
    } else if lo == hi {
        short(lo)
    } else {
        format!("{}–{}", short(lo), short(hi))
    };
    if non_finite > 0 {
        s.push_str(&format!(" ({non_finite} non-finite)"));
    }
    s
}

/// One line per layer: how many weights in which formats, the range of weight amaxes the
/// tensor scales imply, input scales (and how many quantized weights lack one), and the worst
/// block-scale health of the layer.
pub fn render_summary(rows: &[InspectRow], width: usize) -> String {
    let mut groups: Vec<(String, Vec<&InspectRow>)> = Vec::new();
    for r in rows {
        let l = layer_of(&r.canonical);
        match groups.iter_mut().find(|(k, _)| *k == l) {
            Some((_, v)) => v.push(r),
            None => groups.push((l, vec![r])),
        }
    }
    let mut t = crate::output::term::table(width);
    t.set_header([
        "layer",
        "weights",
        "formats",
        "weight amax\n(from scales)",
        "input amax\n(from scales)",
        "block scales\n(worst of the layer)",
    ]);
    for (l, rs) in &groups {
        let mut formats: Vec<(&str, usize)> = Vec::new();
        for r in rs {
            match formats.iter_mut().find(|(f, _)| *f == r.scheme) {
                Some((_, n)) => *n += 1,
                None => formats.push((r.scheme, 1)),
            }
        }
        let quantized: Vec<&&InspectRow> = rs.iter().filter(|r| r.convention.is_some()).collect();
        let missing_input = quantized
            .iter()
            .filter(|r| r.input_global_scale.is_none())
            .count();
        let mut input = range_cell(quantized.iter().filter_map(|r| r.input_amax_implied));
        if missing_input > 0 && missing_input < quantized.len() {
            input.push_str(&format!(" ({missing_input} without)"));
        }
        let worst = |f: fn(&ScaleSummary) -> f64| {
            rs.iter()
                .filter_map(|r| r.block_scale.as_ref().map(f))
                .fold(0f64, f64::max)
        };
        let has_scales = rs.iter().any(|r| r.block_scale.is_some());
        t.add_row([
            l.clone(),
            rs.len().to_string(),
            formats
                .iter()
                .map(|(f, n)| format!("{f} ×{n}"))
                .collect::<Vec<_>>()
                .join(", "),
            range_cell(rs.iter().filter_map(|r| r.weight_amax_implied)),
            input,
            if has_scales {
                format!(
                    "0x00 {} · 0x7E {} · NaN {}",
                    pct(worst(|s| s.frac_zero)),
                    pct(worst(|s| s.frac_7e)),
                    pct(worst(|s| s.frac_nan))
                )
            } else {
                "-".into()
            },
        ]);
    }
    // every column stays whole but the formats, which wrap after their commas
    let max = t.column_max_content_widths();
    for (i, w) in max.iter().enumerate().filter(|(i, _)| *i != 2) {
        crate::output::term::keep(&mut t, i, *w as usize);
    }
    t.to_string()
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

/// A number in five significant digits for a table cell (the JSON keeps every digit).
fn short(x: f32) -> String {
    let a = x.abs();
    if x.is_nan() || x.is_infinite() || x == 0.0 {
        format!("{x}")
    } else if (1e-3..1e6).contains(&a) {
        let decimals = (4 - a.log10().floor() as i32).max(0) as usize;
        let t = format!("{x:.decimals$}");
        if t.contains('.') {
            t.trim_end_matches('0').trim_end_matches('.').to_string()
        } else {
            t
        }
    } else {
        format!("{x:.4e}")
    }
}

/// A global scale as stored, then the amax it implies: `2060.3 → 1.3047`.
fn global_cell(stored: Option<f32>, implied: Option<f32>) -> String {
    match (stored, implied) {
        (Some(s), Some(a)) => format!("{} → {}", short(s), short(a)),
        (Some(s), None) => short(s),
        _ => "-".into(),
    }
}

/// One row per weight (no separators between rows), within `width` columns: the canonical name
/// with the raw name under it when that is not the canonical name plus a suffix (HF naming),
/// long names broken at their dots; the tensor and activation global scales (stored, then the
/// amax they imply) in one cell.
pub fn render_table(rows: &[InspectRow], width: usize) -> String {
    use crate::output::term::{cell_width, spare, wrap_name};
    let raw_differs = rows.iter().any(|r| !r.raw.starts_with(&r.canonical));
    let header = vec![
        if raw_differs {
            "weight\n(raw name)"
        } else {
            "weight"
        },
        "scheme\nconv",
        "shape",
        "global scales\n(→ amax)",
        "block scales",
        "amax from\nscales",
    ];
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            let scales = match (r.weight_global_scale, r.input_global_scale) {
                (None, None) => "-".to_string(),
                (w, i) => format!(
                    "w {}\nin {}",
                    global_cell(w, r.weight_amax_implied),
                    global_cell(i, r.input_amax_implied)
                ),
            };
            [
                format!("{}\n{}", r.scheme, r.convention.unwrap_or("-")),
                format!("{}×{}", r.shape[0], r.shape[1]),
                scales,
                // two lines: the table fits 120 columns with every weight's name whole
                scale_cell(&r.block_scale).replacen(" · NaN", "\n· NaN", 1),
                r.weight_amax_from_scales
                    .map(num)
                    .unwrap_or_else(|| "-".into()),
            ]
        })
        .collect();
    let others: Vec<usize> = (0..5)
        .map(|i| {
            cells
                .iter()
                .map(|c| cell_width(&c[i]))
                .chain([cell_width(header[i + 1])])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let name_max = spare(width, &others).max(30);
    let mut t = crate::output::term::table(width);
    t.set_header(header);
    let mut name_w = 0;
    for (r, c) in rows.iter().zip(cells) {
        let mut name = wrap_name(&r.canonical, name_max);
        if raw_differs && r.raw != r.canonical {
            name.push('\n');
            name.push_str(&wrap_name(&r.raw, name_max));
        }
        name_w = name_w.max(cell_width(&name));
        let mut row = vec![name];
        row.extend(c);
        t.add_row(row);
    }
    // names, schemes, shapes, block scales and amaxes stay whole; the global scales wrap
    use crate::output::term::keep;
    keep(&mut t, 0, name_w);
    for (i, w) in others.iter().enumerate().filter(|(i, _)| *i != 2) {
        keep(&mut t, i + 1, *w);
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

fn dequant(ck: &Checkpoint, args: &InspectArgs, mut outs: Outputs, name: &str) -> Result<i32> {
    let out = args
        .out
        .as_ref()
        .ok_or_else(|| Error::usage("--dequant needs --out FILE.safetensors"))?;
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
    outs.file(out, &buf)?;
    outs.publish()?;
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
    // refused before the checkpoint is opened, and again with its shards known
    let early = Outputs::new(Guard::new().model_dir(&args.model));
    for out in [&args.json, &args.out].into_iter().flatten() {
        early.check(out)?;
    }
    let ck = Checkpoint::open(&args.model)?;
    // a config `run` refuses: the tensors are still described, and the exit is 2
    let refused = crate::lint::warn_incomplete(&ck);
    let mut outs = Outputs::new(Guard::new().model_dir(&args.model).checkpoint(&ck));
    for out in [&args.json, &args.out].into_iter().flatten() {
        outs.check(out)?;
    }
    if let Some(name) = &args.dequant {
        let code = dequant(&ck, args, outs, name)?;
        return Ok(if refused {
            crate::error::EXIT_UNUSABLE
        } else {
            code
        });
    }
    let mut rows = rows(&ck)?;
    if let Some(g) = &args.filter {
        rows.retain(|r| glob_match(g, &r.canonical) || glob_match(g, &r.raw));
        if rows.is_empty() {
            return Err(Error::usage(format!(
                "--filter {g}: no weight of {} matches (patterns use `*` and `?` over canonical names like \
                 `layers.3.ffn.experts.*.w1` or raw tensor names)",
                ck.location().display()
            )));
        }
    }
    if let Some(j) = &args.json {
        let doc = InspectJson {
            schema: SCHEMA,
            model: ck.location(),
            naming: ck.naming().as_str(),
            weights: &rows,
        };
        let text =
            serde_json::to_string_pretty(&doc).map_err(|e| Error::bad(j, None, e.to_string()))?;
        outs.file(j, text.as_bytes())?;
    }
    outs.publish_and_report()?;
    let width = crate::output::term::width();
    let head = format!(
        "{}: {} weights{}, {} naming",
        ck.location().display(),
        rows.len(),
        args.filter
            .as_ref()
            .map(|g| format!(" matching {g}"))
            .unwrap_or_default(),
        ck.naming().as_str()
    );
    println!("{}", crate::output::term::fit(&head, width));
    if args.all || args.filter.is_some() {
        println!("{}", render_table(&rows, width));
    } else {
        println!("{}", render_summary(&rows, width));
        println!(
            "{}",
            crate::output::term::fit(
                "one line per layer; `--filter 'layers.3.*'` lists those weights, `--all` every weight, \
                 `lint` checks their scales",
                width
            )
        );
    }
    if refused {
        eprintln!(
            "error: {}: `run` refuses this config (see the warnings above); the weights are listed as stored",
            ck.config_path().display()
        );
        return Ok(crate::error::EXIT_UNUSABLE);
    }
    Ok(crate::error::EXIT_OK)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_sort_in_layer_order_with_numbers_as_numbers() {
        let mut v = vec![
            "head",
            "layers.10.attn.wq_a",
            "layers.2.ffn.experts.12.w1",
            "layers.2.ffn.experts.3.w1",
            "layers.2.attn.wq_a",
            "embed",
            "layers.9.ffn.shared_experts.w1",
        ];
        v.sort_by_cached_key(|n| order_key(n));
        assert_eq!(
            v,
            [
                "embed",
                "layers.2.attn.wq_a",
                "layers.2.ffn.experts.3.w1",
                "layers.2.ffn.experts.12.w1",
                "layers.9.ffn.shared_experts.w1",
                "layers.10.attn.wq_a",
                "head",
            ]
        );
        assert_eq!(layer_of("layers.12.attn.wkv"), "L12");
        assert_eq!(layer_of("head"), "head");
    }
}
