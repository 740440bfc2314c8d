//! Plots of a run JSON, for issues and PR comments: amax per op, 1 − cos per op against the BF16
//! oracle with each op's tolerance and its divergent ops marked, and a layer × op-kind heatmap of
//! the isolated rel-L2 with its divergent cells outlined. Legends sit in a strip of their own, so
//! they never cover data.
//!
//! Text is drawn with the DejaVu Sans font embedded in the binary (assets/fonts), registered with
//! plotters under the `sans-serif` family, so the plots look the same on a bare CI runner with no
//! system fonts. PNG or SVG follows the output extension.

use crate::output::{Guard, Outputs};
use crate::run_json::layer_of;
use crate::{Error, Result};
use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::{FontStyle, FontTransform};
use serde_json::Value;
use std::fmt::Display;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

static DEJAVU: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const FONT: &str = "sans-serif";

/// Registers the embedded font once per process; plotters' ab_glyph backend has no other fonts.
fn ensure_font() -> Result<()> {
    static DONE: OnceLock<bool> = OnceLock::new();
    let ok = *DONE
        .get_or_init(|| plotters::style::register_font(FONT, FontStyle::Normal, DEJAVU).is_ok());
    if ok {
        Ok(())
    } else {
        Err(Error::Backend(
            "embedded DejaVu Sans font could not be parsed".into(),
        ))
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Format {
    Png,
    Svg,
}

/// One op's numbers the plots use; `None` where the run JSON has null (non-finite) or nothing.
#[derive(Clone, Debug, Default)]
struct OpRow {
    id: String,
    layer: Option<i64>,
    /// oracle_fp32, oracle_bf16, served (propagated)
    amax: [Option<f64>; 3],
    served_non_finite: bool,
    iso_cos: Option<f64>,
    prop_cos: Option<f64>,
    floor_cos: Option<f64>,
    iso_non_finite: bool,
    iso_rel_l2: Option<f64>,
    /// The op's tolerance for its isolated rel-L2.
    tolerance: Option<f64>,
    /// The op's isolated error is beyond its tolerance (`divergent` in the run JSON).
    divergent: bool,
}

const PATHS: [&str; 3] = ["oracle_fp32", "oracle_bf16", "served"];

fn num(v: &Value, path: &[&str]) -> Option<f64> {
    let mut v = v;
    for p in path {
        v = v.get(*p)?;
    }
    v.as_f64().filter(|x| x.is_finite())
}

fn count(v: &Value, path: &str, what: &str) -> u64 {
    v.get("stats")
        .and_then(|s| s.get(path))
        .and_then(|p| p.get(what))
        .and_then(Value::as_u64)
        .unwrap_or(0)
}

fn rows(run: &Value) -> Vec<OpRow> {
    let mut ops: Vec<(f64, usize, &Value)> = run
        .get("ops")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .enumerate()
        .map(|(i, o)| (num(o, &["step"]).unwrap_or(i as f64), i, o))
        .collect();
    // execution order is the step; array order breaks ties and covers a missing step
    ops.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)));
    ops.into_iter()
        .filter_map(|(_, _, o)| {
            let id = o.get("id")?.as_str()?.to_string();
            let nf = |p: &str| count(o, p, "nan") + count(o, p, "inf") > 0;
            Some(OpRow {
                layer: layer_of(&id, o),
                amax: PATHS.map(|p| num(o, &["stats", p, "amax"])),
                served_non_finite: nf("served"),
                iso_cos: num(o, &["served_isolated_vs_bf16", "cos"]),
                prop_cos: num(o, &["served_propagated_vs_bf16", "cos"]),
                floor_cos: num(o, &["bf16_vs_fp32", "cos"]),
                iso_non_finite: nf("served_isolated"),
                iso_rel_l2: num(o, &["served_isolated_vs_bf16", "rel_l2"]),
                tolerance: num(o, &["tolerance"]).filter(|t| *t > 0.0),
                divergent: o.get("divergent").and_then(Value::as_bool) == Some(true),
                id,
            })
        })
        .collect()
}

/// The three plots' kinds, in the order they are written.
const KINDS: [&str; 3] = ["amax", "cos", "heatmap"];

/// `STEM-amax.EXT`, `STEM-cos.EXT`, `STEM-heatmap.EXT` next to `out` (`STEM.EXT`, EXT `png` or
/// `svg`), with the format; an error for any other extension.
fn targets(out: &Path) -> Result<(Format, Vec<PathBuf>)> {
    let ext = out
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .unwrap_or_default();
    let format = match ext.as_str() {
        "png" => Format::Png,
        "svg" => Format::Svg,
        _ => {
            return Err(Error::usage(format!(
                "{}: plot output must end in .png or .svg",
                out.display()
            )))
        }
    };
    let stem = out
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| Error::usage(format!("{}: no file name", out.display())))?;
    let dir = out.parent().unwrap_or(Path::new(""));
    let files = KINDS
        .iter()
        .map(|k| dir.join(format!("{stem}-{k}.{ext}")))
        .collect();
    Ok((format, files))
}

/// The files [`plot_run`] writes for `out` (to check them before the work starts).
pub fn plot_files(out: &Path) -> Result<Vec<PathBuf>> {
    targets(out).map(|(_, f)| f)
}

/// Writes `STEM-amax.EXT`, `STEM-cos.EXT` and `STEM-heatmap.EXT` next to `out` (`STEM.EXT`, EXT
/// `png` or `svg`), all or none, and returns their paths.
pub fn plot_run(run_json_text: &str, out: &Path) -> Result<Vec<PathBuf>> {
    let run = crate::run_json::parse_run(run_json_text, "run JSON")?;
    plot_value(&run, out)
}

/// [`plot_run`] of a run JSON already read and checked by [`crate::run_json::load_run`].
pub fn plot_value(run: &Value, out: &Path) -> Result<Vec<PathBuf>> {
    let mut outs = Outputs::new(Guard::new());
    plot_into(run, out, &mut outs)?;
    outs.publish()
}

/// As [`plot_run`], staging the three files in `outs` (published with the command's other
/// outputs); returns their paths.
pub fn plot_into(run: &Value, out: &Path, outs: &mut Outputs) -> Result<Vec<PathBuf>> {
    let (format, files) = targets(out)?;
    for f in &files {
        outs.check(f)?;
    }
    ensure_font()?;
    let ops = rows(run);
    let title_suffix = describe(run);

    let amax = AmaxPlot {
        ops: &ops,
        suffix: &title_suffix,
    };
    let cos = CosPlot {
        ops: &ops,
        suffix: &title_suffix,
    };
    let heat = Heatmap::new(&ops, &title_suffix);
    for (plot, p) in [&amax as &dyn Sized2, &cos, &heat].into_iter().zip(&files) {
        outs.file_with(p, |tmp| plot.write(tmp, format))?;
    }
    Ok(files)
}

/// `checkpoint · profile · layers` for titles, so a pasted plot says what it shows.
fn describe(run: &Value) -> String {
    let mut parts = Vec::new();
    if let Some(l) = run.pointer("/checkpoint/location").and_then(Value::as_str) {
        let short = Path::new(l)
            .file_name()
            .and_then(|f| f.to_str())
            .unwrap_or(l);
        parts.push(short.to_string());
    }
    if let Some(p) = run.get("served_profile").and_then(Value::as_str) {
        parts.push(p.to_string());
    }
    if let Some(l) = run.get("layers").and_then(Value::as_array) {
        if let [a, b] = l.as_slice() {
            parts.push(format!("layers {a}–{b}"));
        }
    }
    parts.join(" · ")
}

type PResult = std::result::Result<(), String>;

trait Ctx<T> {
    fn ctx(self) -> std::result::Result<T, String>;
}
impl<T, E: Display> Ctx<T> for std::result::Result<T, E> {
    fn ctx(self) -> std::result::Result<T, String> {
        self.map_err(|e| e.to_string())
    }
}

/// A plot drawable on any plotters backend.
trait Plot {
    fn size(&self) -> (u32, u32);
    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> PResult;
}

/// Object-safe face of [`Plot`], so the three plots go through one loop.
trait Sized2 {
    fn write(&self, path: &Path, format: Format) -> Result<()>;
}

impl<P: Plot> Sized2 for P {
    fn write(&self, path: &Path, format: Format) -> Result<()> {
        let size = self.size();
        let fail = |e: String| Error::io(path, std::io::Error::other(format!("plot: {e}")));
        match format {
            Format::Png => {
                let root = BitMapBackend::new(path, size).into_drawing_area();
                root.fill(&WHITE).ctx().map_err(fail)?;
                self.draw(&root).map_err(fail)?;
                root.present().ctx().map_err(fail)?;
            }
            Format::Svg => {
                let root = SVGBackend::new(path, size).into_drawing_area();
                root.fill(&WHITE).ctx().map_err(fail)?;
                self.draw(&root).map_err(fail)?;
                root.present().ctx().map_err(fail)?;
            }
        }
        Ok(())
    }
}

fn title_style() -> TextStyle<'static> {
    (FONT, 24).into_font().color(&BLACK)
}

fn font(size: u32) -> FontDesc<'static> {
    (FONT, size).into_font()
}

/// Y-axis descriptions are rotated a quarter turn counter-clockwise.
fn y_desc_style() -> TextStyle<'static> {
    font(17).transform(FontTransform::Rotate270).color(&BLACK)
}

const SERIES_COLOURS: [RGBColor; 3] = [
    RGBColor(31, 119, 180),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
];

/// Width that leaves room for one rotated label per op up to a cap; labels are thinned beyond it.
fn width_for(n: usize) -> u32 {
    (260 + 16 * n as u32).clamp(1100, 3600)
}

/// Label area for rotated op ids: room for the longest id shown.
fn label_area(ops: &[OpRow]) -> u32 {
    let longest = ops.iter().map(|o| o.id.chars().count()).max().unwrap_or(4) as u32;
    (16 + 7 * longest).min(260)
}

/// Draws op ids under the x axis, reading downwards from just below it. plotters centres rotated
/// tick labels on the tick, which pushes half of each label into the plot where it is clipped;
/// drawing them here keeps them whole. Labels closer than 15 px are thinned to every k-th.
fn draw_x_labels<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    at: &[((i32, i32), String)],
    size: u32,
) -> PResult {
    let spacing = if at.len() > 1 {
        ((at[at.len() - 1].0 .0 - at[0].0 .0) as f64 / (at.len() - 1) as f64).abs()
    } else {
        f64::INFINITY
    };
    let step = (15.0 / spacing).ceil().max(1.0) as usize;
    let style = font(size)
        .transform(FontTransform::Rotate90)
        .color(&BLACK)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for ((x, y), text) in at.iter().step_by(step) {
        root.draw(&Text::new(text.clone(), (*x, *y + 8), style.clone()))
            .ctx()?;
    }
    Ok(())
}

/// Pixel positions of op ticks on the x axis of a line chart.
fn op_label_positions<DB: DrawingBackend>(
    chart: &ChartContext<'_, DB, LogChart>,
    ops: &[OpRow],
    y_bottom: f64,
) -> Vec<((i32, i32), String)> {
    ops.iter()
        .enumerate()
        .map(|(i, o)| (chart.backend_coord(&(i as i32, y_bottom)), o.id.clone()))
        .collect()
}

type LogChart = Cartesian2d<
    plotters::coord::types::RangedCoordi32,
    plotters::coord::combinators::LogCoord<f64>,
>;

/// Splits a series where values are missing, so a NaN op shows as a gap, not as a bridge.
fn segments(vals: impl Iterator<Item = Option<f64>>) -> Vec<Vec<(i32, f64)>> {
    let mut out: Vec<Vec<(i32, f64)>> = vec![Vec::new()];
    for (i, v) in vals.enumerate() {
        match v {
            Some(y) => out
                .last_mut()
                .unwrap_or(&mut Vec::new())
                .push((i as i32, y)),
            None => {
                if out.last().is_some_and(|s| !s.is_empty()) {
                    out.push(Vec::new());
                }
            }
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// Log-axis range over the positive values, padded; a fixed decade when there are none.
fn log_range(vals: impl Iterator<Item = f64>) -> (f64, f64) {
    // narrow data: ×/÷4 around its middle; wide data: ×/÷2 beyond its ends
    log_bounds(vals, 4f64.log10(), 2f64.log10(), 1.0)
}

/// The smallest and largest value a log axis is given. plotters' log coordinates need finite
/// positive ends: padding a value near f64's limits (an amax of 1e308) overflowed to infinity,
/// and an infinite range made plotters loop forever allocating tick marks. So values are clamped
/// to [1e-300, 1e300] and padded in log10 space.
const LOG_MIN: f64 = 1e-300;
const LOG_MAX: f64 = 1e300;

/// Range of the positive finite `vals` in log10 space: data spanning less than `narrow` decades
/// is centred in ±`pad_narrow` decades, wider data padded by `pad_wide` decades at each end.
fn log_bounds(
    vals: impl Iterator<Item = f64>,
    pad_narrow: f64,
    pad_wide: f64,
    narrow: f64,
) -> (f64, f64) {
    let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
    for v in vals.filter(|v| *v > 0.0 && v.is_finite()) {
        let l = v.clamp(LOG_MIN, LOG_MAX).log10();
        lo = lo.min(l);
        hi = hi.max(l);
    }
    if !lo.is_finite() {
        return (1e-3, 1.0);
    }
    let (a, b) = if hi - lo < narrow {
        let mid = (hi + lo) / 2.0;
        (mid - pad_narrow, mid + pad_narrow)
    } else {
        (lo - pad_wide, hi + pad_wide)
    };
    let (min, max) = (LOG_MIN.log10(), LOG_MAX.log10());
    (10f64.powf(a.clamp(min, max)), 10f64.powf(b.clamp(min, max)))
}

/// Tick labels of a log axis: plain decimals between 0.001 and 10⁴, `2e-5` style outside.
fn fmt_log_tick(v: &f64) -> String {
    let v = *v;
    if v <= 0.0 || !v.is_finite() {
        return String::new();
    }
    let e = v.log10().floor() as i32;
    let m = v / 10f64.powi(e);
    let m = (m * 10.0).round() / 10.0;
    if (-3..4).contains(&e) {
        let decimals = if m.fract() == 0.0 {
            (-e).max(0)
        } else {
            (1 - e).max(0)
        } as usize;
        format!("{v:.decimals$}")
    } else if m.fract() == 0.0 {
        format!("{}e{e}", m as i64)
    } else {
        format!("{m:.1}e{e}")
    }
}

/// How a legend entry is drawn.
#[derive(Clone, Copy)]
enum Mark {
    /// A line, `dashed` or solid, with or without dots.
    Line(RGBColor, bool, bool),
    /// Dots only.
    Dots(RGBColor),
    /// A cross (non-finite values).
    Cross(RGBColor),
    /// A translucent band with a triangle (divergent ops).
    Diverges,
}

/// Height of the legend strip under a chart.
const LEGEND_STRIP: u32 = 64;

/// The legend in a strip of its own (below the op labels), entries left to right, wrapping to a
/// second row: it can never cover data.
fn draw_legend_strip<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    items: &[(String, Mark)],
) -> PResult {
    let (w, _) = area.dim_in_pixel();
    let (mut x, mut y) = (24i32, 12i32);
    for (label, mark) in items {
        let text_w = 8 * label.chars().count() as i32;
        if x > 24 && x + 40 + text_w > w as i32 - 16 {
            x = 24;
            y += 26;
        }
        let mid = y + 8;
        match *mark {
            Mark::Line(c, dashed, dots) => {
                if dashed {
                    for k in 0..3 {
                        area.draw(&PathElement::new(
                            vec![(x + 10 * k, mid), (x + 10 * k + 6, mid)],
                            c.stroke_width(3),
                        ))
                        .ctx()?;
                    }
                } else {
                    area.draw(&PathElement::new(
                        vec![(x, mid), (x + 26, mid)],
                        c.stroke_width(3),
                    ))
                    .ctx()?;
                }
                if dots {
                    area.draw(&Circle::new((x + 13, mid), 3, c.filled()))
                        .ctx()?;
                }
            }
            Mark::Dots(c) => {
                for k in 0..3 {
                    area.draw(&Circle::new((x + 3 + 10 * k, mid), 3, c.filled()))
                        .ctx()?;
                }
            }
            Mark::Cross(c) => {
                area.draw(&Cross::new((x + 13, mid), 6, c.stroke_width(3)))
                    .ctx()?;
            }
            Mark::Diverges => {
                area.draw(&Rectangle::new(
                    [(x + 8, mid - 10), (x + 18, mid + 10)],
                    DIVERGES.mix(0.25).filled(),
                ))
                .ctx()?;
                area.draw(&TriangleMarker::new((x + 13, mid), 7, DIVERGES.filled()))
                    .ctx()?;
            }
        }
        area.draw(&Text::new(
            label.clone(),
            (x + 34, mid),
            font(15)
                .color(&BLACK)
                .pos(Pos::new(HPos::Left, VPos::Center)),
        ))
        .ctx()?;
        x += 34 + text_w + 28;
    }
    Ok(())
}

/// The colour of divergent ops in every plot.
const DIVERGES: RGBColor = RGBColor(200, 0, 0);

struct AmaxPlot<'a> {
    ops: &'a [OpRow],
    suffix: &'a str,
}

impl Plot for AmaxPlot<'_> {
    fn size(&self) -> (u32, u32) {
        (width_for(self.ops.len()), 820 + LEGEND_STRIP)
    }
    fn draw<DB: DrawingBackend>(&self, whole: &DrawingArea<DB, Shift>) -> PResult {
        let (_, h) = whole.dim_in_pixel();
        let (root, strip) = whole.split_vertically(h - LEGEND_STRIP);
        let root = &root;
        let mut legend: Vec<(String, Mark)> = Vec::new();
        let n = self.ops.len();
        let (lo, hi) = log_range(
            self.ops
                .iter()
                .flat_map(|o| o.amax.iter().flatten().copied()),
        );
        let mut chart = ChartBuilder::on(root)
            .caption(
                format!("amax per op, execution order — {}", self.suffix),
                title_style(),
            )
            .margin(16)
            .x_label_area_size(label_area(self.ops))
            .y_label_area_size(90)
            .build_cartesian_2d(-1i32..n as i32, (lo..hi).log_scale())
            .ctx()?;
        chart
            .configure_mesh()
            .x_labels(n + 2)
            .x_label_formatter(&|_| String::new())
            .y_labels(12)
            .y_label_formatter(&fmt_log_tick)
            .y_label_style(font(14))
            .y_desc("amax = max |x| (log scale)")
            .x_desc("")
            .axis_desc_style(y_desc_style())
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .ctx()?;
        for (k, path) in PATHS.iter().enumerate() {
            let colour = SERIES_COLOURS[k];
            let segs = segments(self.ops.iter().map(|o| o.amax[k]));
            // the oracles usually coincide: the FP32 one is drawn wide underneath so both show
            let width = if k == 0 { 6 } else { 2 };
            for (si, seg) in segs.iter().enumerate() {
                let s = chart
                    .draw_series(LineSeries::new(
                        seg.iter().copied(),
                        colour.stroke_width(width),
                    ))
                    .ctx()?;
                if si == 0 {
                    legend.push((path.to_string(), Mark::Line(colour, false, true)));
                }
                let _ = s;
                chart
                    .draw_series(seg.iter().map(|p| Circle::new(*p, 3, colour.filled())))
                    .ctx()?;
            }
        }
        if draw_non_finite_marks(&mut chart, self.ops.iter().map(|o| o.served_non_finite), hi)? {
            legend.push(("served has NaN/Inf".into(), Mark::Cross(DIVERGES)));
        }
        if draw_divergent(&mut chart, self.ops, |o| o.amax[2], lo, hi)? {
            legend.push((
                "diverges (isolated rel-L2 > its tolerance)".into(),
                Mark::Diverges,
            ));
        }
        draw_x_labels(root, &op_label_positions(&chart, self.ops, lo), 12)?;
        draw_legend_strip(&strip, &legend)?;
        Ok(())
    }
}

/// Red crosses along the top edge at ops whose values are non-finite (nothing to plot there);
/// whether there were any (for the legend).
fn draw_non_finite_marks<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, LogChart>,
    flags: impl Iterator<Item = bool>,
    top: f64,
) -> std::result::Result<bool, String> {
    let y = top / 1.25;
    let pts: Vec<(i32, f64)> = flags
        .enumerate()
        .filter(|(_, f)| *f)
        .map(|(i, _)| (i as i32, y))
        .collect();
    if pts.is_empty() {
        return Ok(false);
    }
    chart
        .draw_series(
            pts.into_iter()
                .map(|p| Cross::new(p, 7, DIVERGES.stroke_width(3))),
        )
        .ctx()?;
    Ok(true)
}

/// A translucent red band over the whole height at every divergent op, and a red triangle at
/// the op's value (`at`; at the top when it has none); whether there were any.
fn draw_divergent<DB: DrawingBackend>(
    chart: &mut ChartContext<'_, DB, LogChart>,
    ops: &[OpRow],
    at: impl Fn(&OpRow) -> Option<f64>,
    lo: f64,
    hi: f64,
) -> std::result::Result<bool, String> {
    let idx: Vec<usize> = (0..ops.len()).filter(|&i| ops[i].divergent).collect();
    if idx.is_empty() {
        return Ok(false);
    }
    chart
        .draw_series(idx.iter().map(|&i| {
            PathElement::new(
                vec![(i as i32, lo), (i as i32, hi)],
                DIVERGES.mix(0.22).stroke_width(14),
            )
        }))
        .ctx()?;
    chart
        .draw_series(idx.iter().map(|&i| {
            let y = at(&ops[i]).map_or(hi / 1.6, |v| v.clamp(lo, hi));
            TriangleMarker::new((i as i32, y), 9, DIVERGES.filled())
        }))
        .ctx()?;
    Ok(true)
}

struct CosPlot<'a> {
    ops: &'a [OpRow],
    suffix: &'a str,
}

/// 1 − cos of an exact match (cos = 1) has no place on a log axis: such ops are left out of
/// the series (a gap, not a tooth down to an arbitrary floor).
fn one_minus(c: Option<f64>) -> Option<f64> {
    c.map(|c| 1.0 - c).filter(|v| *v > 0.0)
}

/// A rel-L2 tolerance on the 1 − cos axis: the 1 − cos of an error of that rel-L2 orthogonal to
/// the values, 1 − 1/√(1 + tol²). (An error along the values, a scale factor, moves rel-L2 and
/// not the cosine: such an op diverges below this line; its band marks it.)
fn tol_as_one_minus_cos(t: f64) -> f64 {
    1.0 - 1.0 / (1.0 + t * t).sqrt()
}

const ISO: RGBColor = RGBColor(255, 127, 14);
const PROP: RGBColor = RGBColor(214, 39, 40);
const FLOOR: RGBColor = RGBColor(110, 110, 110);
const TOL: RGBColor = RGBColor(20, 20, 20);

impl Plot for CosPlot<'_> {
    fn size(&self) -> (u32, u32) {
        (width_for(self.ops.len()), 820 + LEGEND_STRIP)
    }
    fn draw<DB: DrawingBackend>(&self, whole: &DrawingArea<DB, Shift>) -> PResult {
        let (_, h) = whole.dim_in_pixel();
        let (root, strip) = whole.split_vertically(h - LEGEND_STRIP);
        let root = &root;
        let n = self.ops.len();
        let iso: Vec<Option<f64>> = self.ops.iter().map(|o| one_minus(o.iso_cos)).collect();
        let prop: Vec<Option<f64>> = self.ops.iter().map(|o| one_minus(o.prop_cos)).collect();
        let floor: Vec<Option<f64>> = self.ops.iter().map(|o| one_minus(o.floor_cos)).collect();
        // the tolerance of ops that have a cosine (an indexer's is on its agreement)
        let tol: Vec<Option<f64>> = self
            .ops
            .iter()
            .map(|o| {
                o.tolerance
                    .filter(|_| o.iso_cos.is_some() || o.prop_cos.is_some())
                    .map(tol_as_one_minus_cos)
                    .filter(|v| *v > 0.0)
            })
            .collect();
        let (lo, hi) = log_range(
            [&iso, &prop, &floor, &tol]
                .into_iter()
                .flat_map(|s| s.iter().flatten().copied()),
        );
        let hi = hi.min(2.5).max(lo * 10.0);
        let clamp = |v: &Vec<Option<f64>>| -> Vec<Option<f64>> {
            v.iter().map(|x| x.map(|x| x.clamp(lo, hi))).collect()
        };
        let (iso, prop, floor, tol) = (clamp(&iso), clamp(&prop), clamp(&floor), clamp(&tol));
        let mut chart = ChartBuilder::on(root)
            .caption(
                format!("1 − cos vs the BF16 oracle per op — {}", self.suffix),
                title_style(),
            )
            .margin(16)
            .x_label_area_size(label_area(self.ops))
            .y_label_area_size(90)
            .build_cartesian_2d(-1i32..n as i32, (lo..hi).log_scale())
            .ctx()?;
        chart
            .configure_mesh()
            .x_labels(n + 2)
            .x_label_formatter(&|_| String::new())
            .y_labels(12)
            .y_label_formatter(&fmt_log_tick)
            .y_label_style(font(14))
            .y_desc("1 − cosine similarity (log scale)")
            .axis_desc_style(y_desc_style())
            .light_line_style(RGBColor(235, 235, 235))
            .draw()
            .ctx()?;
        let mut legend: Vec<(String, Mark)> = Vec::new();
        let any = |v: &Vec<Option<f64>>| v.iter().any(Option::is_some);
        if draw_divergent(&mut chart, self.ops, |o| one_minus(o.iso_cos), lo, hi)? {
            legend.push((
                "diverges (isolated rel-L2 > its tolerance)".into(),
                Mark::Diverges,
            ));
        }
        // the tolerance: a bar across each op's slot
        let bar = (self.size().0 as f64 / (n as f64 + 2.0) * 0.4).clamp(2.0, 9.0) as i32;
        chart
            .draw_series(tol.iter().enumerate().filter_map(|(i, v)| {
                v.map(|y| {
                    EmptyElement::at((i as i32, y))
                        + PathElement::new(vec![(-bar, 0), (bar, 0)], TOL.stroke_width(3))
                })
            }))
            .ctx()?;
        if any(&tol) {
            legend.push((
                "tolerance (its rel-L2 as the 1 − cos of an orthogonal error)".into(),
                Mark::Line(TOL, false, false),
            ));
        }
        for seg in segments(floor.iter().copied()) {
            chart
                .draw_series(DashedLineSeries::new(seg, 6, 4, FLOOR.stroke_width(2)))
                .ctx()?;
        }
        if any(&floor) {
            legend.push((
                "noise floor: BF16 vs FP32 oracle".into(),
                Mark::Line(FLOOR, true, false),
            ));
        }
        for seg in segments(prop.iter().copied()) {
            chart
                .draw_series(LineSeries::new(seg.iter().copied(), PROP.stroke_width(2)))
                .ctx()?;
            chart
                .draw_series(seg.iter().map(|p| Circle::new(*p, 3, PROP.filled())))
                .ctx()?;
        }
        if any(&prop) {
            legend.push((
                "served propagated vs BF16 oracle".into(),
                Mark::Line(PROP, false, true),
            ));
        }
        // isolated: one dot per op (an op exact in isolation has none)
        chart
            .draw_series(
                iso.iter()
                    .enumerate()
                    .filter_map(|(i, v)| v.map(|v| Circle::new((i as i32, v), 4, ISO.filled()))),
            )
            .ctx()?;
        if any(&iso) {
            legend.push((
                "served isolated vs BF16 oracle (exact ops: no dot)".into(),
                Mark::Dots(ISO),
            ));
        }
        let undefined = self.ops.iter().map(|o| {
            o.iso_cos.is_none() && o.prop_cos.is_none() && o.tolerance.is_none()
                || o.served_non_finite
                || o.iso_non_finite
        });
        if draw_non_finite_marks(&mut chart, undefined, hi)? {
            legend.push(("cosine undefined (NaN/Inf)".into(), Mark::Cross(DIVERGES)));
        }
        draw_x_labels(root, &op_label_positions(&chart, self.ops, lo), 12)?;
        draw_legend_strip(&strip, &legend)?;
        Ok(())
    }
}

/// Worst isolated rel-L2 per (layer, op kind); the kind is the id without its `L{n}.` prefix.
struct Heatmap<'a> {
    layers: Vec<i64>,
    kinds: Vec<String>,
    /// [layer index][kind index]
    cells: Vec<Vec<Cell>>,
    /// [layer index][kind index]: an op of the cell diverges
    divergent: Vec<Vec<bool>>,
    suffix: &'a str,
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Cell {
    Empty,
    Value(f64),
    NonFinite,
}

fn op_kind(id: &str) -> &str {
    match id.strip_prefix('L').and_then(|r| r.split_once('.')) {
        Some((n, rest)) if n.chars().all(|c| c.is_ascii_digit()) && !n.is_empty() => rest,
        _ => id,
    }
}

impl<'a> Heatmap<'a> {
    fn new(ops: &[OpRow], suffix: &'a str) -> Self {
        let mut layers: Vec<i64> = ops.iter().filter_map(|o| o.layer).collect();
        layers.sort_unstable();
        layers.dedup();
        let mut kinds: Vec<String> = Vec::new();
        for o in ops.iter().filter(|o| o.layer.is_some()) {
            let k = op_kind(&o.id);
            if !kinds.iter().any(|x| x == k) {
                kinds.push(k.to_string());
            }
        }
        let mut cells = vec![vec![Cell::Empty; kinds.len()]; layers.len()];
        let mut divergent = vec![vec![false; kinds.len()]; layers.len()];
        for o in ops {
            let Some(l) = o.layer else { continue };
            let (Ok(li), Some(ki)) = (
                layers.binary_search(&l),
                kinds.iter().position(|k| k == op_kind(&o.id)),
            ) else {
                continue;
            };
            let new = if o.iso_non_finite
                || o.iso_rel_l2.is_none() && o.iso_cos.is_none() && o.amax[2].is_some()
            {
                Cell::NonFinite
            } else if let Some(v) = o.iso_rel_l2 {
                Cell::Value(v)
            } else {
                Cell::Empty
            };
            divergent[li][ki] |= o.divergent;
            let c = &mut cells[li][ki];
            *c = match (*c, new) {
                (Cell::NonFinite, _) | (_, Cell::NonFinite) => Cell::NonFinite,
                (Cell::Value(a), Cell::Value(b)) => Cell::Value(a.max(b)),
                (Cell::Empty, x) | (x, Cell::Empty) => x,
            };
        }
        Heatmap {
            layers,
            kinds,
            cells,
            divergent,
            suffix,
        }
    }

    /// Cell size in pixels: readable cells for real runs, shrinking (down to one pixel) when a
    /// run JSON holds thousands of layers or op kinds, so the image stays within
    /// [`MAX_HEATMAP_PX`] (a hostile JSON once asked for a bitmap of several GB).
    fn cell_px(&self) -> (u32, u32) {
        let fit = |n: usize, want: u32, lo: u32, hi: u32| -> u32 {
            let n = n.max(1).min(u32::MAX as usize) as u32;
            let w = (want / n).clamp(lo, hi);
            if w.saturating_mul(n) > MAX_HEATMAP_PX - 1000 {
                ((MAX_HEATMAP_PX - 1000) / n).max(1)
            } else {
                w
            }
        };
        (
            fit(self.kinds.len(), 1500, 26, 90),
            fit(self.layers.len(), 1100, 14, 44),
        )
    }
}

/// Viridis, sampled at five stops: perceptually ordered and readable in grey.
fn viridis(t: f64) -> RGBColor {
    const STOPS: [(f64, f64, f64); 5] = [
        (68.0, 1.0, 84.0),
        (59.0, 82.0, 139.0),
        (33.0, 145.0, 140.0),
        (94.0, 201.0, 98.0),
        (253.0, 231.0, 37.0),
    ];
    let t = if t.is_finite() {
        t.clamp(0.0, 1.0)
    } else {
        0.0
    } * 4.0;
    let i = (t.floor() as usize).min(3);
    let f = t - i as f64;
    let (a, b) = (STOPS[i], STOPS[i + 1]);
    let mix = |x: f64, y: f64| (x + (y - x) * f).round() as u8;
    RGBColor(mix(a.0, b.0), mix(a.1, b.1), mix(a.2, b.2))
}

/// Largest heatmap side in pixels.
const MAX_HEATMAP_PX: u32 = 8192;

const NON_FINITE: RGBColor = RGBColor(255, 0, 200);
const EMPTY: RGBColor = RGBColor(225, 225, 225);

impl Plot for Heatmap<'_> {
    fn size(&self) -> (u32, u32) {
        let (cw, ch) = self.cell_px();
        let longest = self
            .kinds
            .iter()
            .map(|k| k.chars().count())
            .max()
            .unwrap_or(4) as u32;
        let px = |c: u32, n: usize| c.saturating_mul(n.min(u32::MAX as usize) as u32);
        let w = (120 + 260u32).saturating_add(px(cw, self.kinds.len()));
        let h = (110 + (16 + 7 * longest).min(220)).saturating_add(px(ch, self.layers.len()));
        (w.clamp(900, MAX_HEATMAP_PX), h.clamp(480, MAX_HEATMAP_PX))
    }

    fn draw<DB: DrawingBackend>(&self, root: &DrawingArea<DB, Shift>) -> PResult {
        let (w, _) = self.size();
        let (main, side) = root.split_horizontally(w - 230);
        let nk = self.kinds.len().max(1) as i32;
        let nl = self.layers.len().max(1) as i32;
        let vals: Vec<f64> = self
            .cells
            .iter()
            .flatten()
            .filter_map(|c| match c {
                Cell::Value(v) if *v > 0.0 => Some(*v),
                _ => None,
            })
            .collect();
        // narrow data: ×/÷3.2 around its middle; wide data: exactly its ends
        let (lo, hi) = log_bounds(vals.iter().copied(), 3.2f64.log10(), 0.0, 1.0);
        let t_of = |v: f64| ((v.max(lo)).ln() - lo.ln()) / (hi.ln() - lo.ln());
        let kinds = &self.kinds;
        let layers = &self.layers;
        // row 0 at the bottom of the chart is the last layer, so L0 reads at the top
        let fmt_y = |v: &SegmentValue<i32>| match v {
            SegmentValue::CenterOf(r) => {
                let li = layers.len() as i64 - 1 - *r as i64;
                usize::try_from(li)
                    .ok()
                    .and_then(|i| layers.get(i))
                    .map(|l| format!("L{l}"))
                    .unwrap_or_default()
            }
            _ => String::new(),
        };
        let longest = self
            .kinds
            .iter()
            .map(|k| k.chars().count())
            .max()
            .unwrap_or(4) as u32;
        let mut chart = ChartBuilder::on(&main)
            .caption(
                format!(
                    "worst isolated rel-L2 per layer × op kind — {}",
                    self.suffix
                ),
                title_style(),
            )
            .margin(16)
            .x_label_area_size((16 + 7 * longest).min(220))
            .y_label_area_size(80)
            // an i32 range is inclusive in plotters: 0..n−1 gives n segments
            .build_cartesian_2d((0..nk - 1).into_segmented(), (0..nl - 1).into_segmented())
            .ctx()?;
        chart
            .configure_mesh()
            .disable_mesh()
            .x_labels(nk as usize)
            .y_labels(nl as usize)
            .x_label_formatter(&|_| String::new())
            .y_label_formatter(&fmt_y)
            .y_label_style(font(14))
            .y_desc("layer")
            .axis_desc_style(y_desc_style())
            .draw()
            .ctx()?;
        let (cw, ch) = self.cell_px();
        let show_text = cw >= 52 && ch >= 18;
        for (li, row) in self.cells.iter().enumerate() {
            let r = nl - 1 - li as i32;
            for (ki, cell) in row.iter().enumerate() {
                let k = ki as i32;
                let colour = match cell {
                    Cell::Empty => EMPTY,
                    Cell::NonFinite => NON_FINITE,
                    Cell::Value(v) => viridis(t_of(*v)),
                };
                let rect = Rectangle::new(
                    [
                        (SegmentValue::Exact(k), SegmentValue::Exact(r)),
                        (SegmentValue::Exact(k + 1), SegmentValue::Exact(r + 1)),
                    ],
                    colour.filled(),
                );
                chart.draw_series(std::iter::once(rect)).ctx()?;
                if self.divergent[li][ki] {
                    // a divergent op's cell: a red frame, whatever its colour
                    chart
                        .draw_series(std::iter::once(Rectangle::new(
                            [
                                (SegmentValue::Exact(k), SegmentValue::Exact(r)),
                                (SegmentValue::Exact(k + 1), SegmentValue::Exact(r + 1)),
                            ],
                            DIVERGES.stroke_width(4),
                        )))
                        .ctx()?;
                }
                if show_text {
                    let text = match cell {
                        Cell::Value(v) => format!("{v:.1e}"),
                        Cell::NonFinite => "NaN/Inf".into(),
                        Cell::Empty => String::new(),
                    };
                    if !text.is_empty() {
                        let dark = match cell {
                            Cell::Value(v) => t_of(*v) < 0.6,
                            _ => false,
                        };
                        let style = font(12)
                            .color(if dark { &WHITE } else { &BLACK })
                            .pos(Pos::new(HPos::Center, VPos::Center));
                        chart
                            .draw_series(std::iter::once(Text::new(
                                text,
                                (SegmentValue::CenterOf(k), SegmentValue::CenterOf(r)),
                                style,
                            )))
                            .ctx()?;
                    }
                }
            }
        }
        let at: Vec<((i32, i32), String)> = kinds
            .iter()
            .enumerate()
            .map(|(k, name)| {
                (
                    chart
                        .backend_coord(&(SegmentValue::CenterOf(k as i32), SegmentValue::Exact(0))),
                    name.clone(),
                )
            })
            .collect();
        draw_x_labels(root, &at, 13)?;
        // colour scale: a log axis with the ramp drawn in thin bands
        let (bar, keys) = side.split_vertically(side.dim_in_pixel().1.saturating_sub(150));
        let mut scale = ChartBuilder::on(&bar)
            .margin_top(60)
            .margin_bottom(10)
            .margin_right(20)
            .y_label_area_size(70)
            .caption("rel-L2", (FONT, 16))
            .build_cartesian_2d(0f64..1f64, (lo..hi).log_scale())
            .ctx()?;
        scale
            .configure_mesh()
            .disable_mesh()
            .disable_x_axis()
            .y_labels(10)
            .y_label_formatter(&fmt_log_tick)
            .y_label_style(font(13))
            .draw()
            .ctx()?;
        let steps = 120;
        let ratio = (hi / lo).powf(1.0 / steps as f64);
        scale
            .draw_series((0..steps).map(|i| {
                let a = lo * ratio.powi(i);
                let b = a * ratio;
                Rectangle::new([(0.0, a), (1.0, b)], viridis(t_of((a * b).sqrt())).filled())
            }))
            .ctx()?;
        let key = |y: i32, colour: RGBColor, text: &str| -> PResult {
            keys.draw(&Rectangle::new([(20, y), (40, y + 16)], colour.filled()))
                .ctx()?;
            keys.draw(&Rectangle::new(
                [(20, y), (40, y + 16)],
                BLACK.stroke_width(1),
            ))
            .ctx()?;
            keys.draw(&Text::new(text.to_string(), (48, y), font(14)))
                .ctx()?;
            Ok(())
        };
        key(20, NON_FINITE, "NaN/Inf in served")?;
        key(46, EMPTY, "no such op")?;
        if self.divergent.iter().flatten().any(|d| *d) {
            keys.draw(&Rectangle::new(
                [(20, 72), (40, 88)],
                DIVERGES.stroke_width(4),
            ))
            .ctx()?;
            keys.draw(&Text::new("diverges (> tolerance)", (48, 72), font(14)))
                .ctx()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod range_tests {
    use super::*;

    #[test]
    fn log_ranges_stay_finite_at_the_limits_of_f64() {
        for vals in [
            vec![1e308],
            vec![f64::MAX, 1.0],
            vec![1e308, 1e308, 1e308],
            vec![f64::MIN_POSITIVE, 1e-320, 1.0],
            vec![],
            vec![f64::NAN, f64::INFINITY, -1.0, 0.0],
        ] {
            let (lo, hi) = log_range(vals.iter().copied());
            assert!(
                lo.is_finite() && hi.is_finite() && lo > 0.0 && hi > lo,
                "{vals:?}: {lo} {hi}"
            );
            assert!((hi / lo).log10() < 700.0);
        }
        // ordinary data keeps the old padding: ×/÷4 around a narrow range, ×/÷2 beyond a wide one
        let (lo, hi) = log_range([2.0, 4.0].into_iter());
        let mid = 8f64.sqrt();
        assert!((lo - mid / 4.0).abs() < 1e-12 && (hi - mid * 4.0).abs() < 1e-12);
        let (lo, hi) = log_range([0.01, 100.0].into_iter());
        assert!((lo - 0.005).abs() < 1e-15 && (hi - 200.0).abs() < 1e-9);
    }

    #[test]
    fn heatmaps_of_many_layers_stay_bounded() {
        let ops: Vec<OpRow> = (0..20_000)
            .map(|l| OpRow {
                id: format!("L{l}.attn.q_a"),
                layer: Some(l),
                iso_rel_l2: Some(1e308),
                ..Default::default()
            })
            .collect();
        let h = Heatmap::new(&ops, "");
        let (w, hh) = h.size();
        assert!(w <= MAX_HEATMAP_PX && hh <= MAX_HEATMAP_PX, "{w}×{hh}");
    }
}
