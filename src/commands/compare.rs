//! `compare`: an engine's dumped activations against the oracle on the same tokens.

use comfy_table::{Cell, Color};
use serde::Serialize;

use crate::cli::{BackendChoice, CompareArgs, TokenArgs};
use crate::commands::run::prepare;
use crate::error::{EXIT_FINDINGS, EXIT_OK};
use crate::model::graph::build_graph;
use crate::output::Outputs;
use crate::probe;
use crate::report::{self, RunMeta};
use crate::trace::assemble::{assemble, needed_layers};
use crate::trace::compare::{attributions, evaluate, Inputs, OpCompare, Skipped};
use crate::trace::names::NameMap;
use crate::trace::read::Trace;
use crate::{Error, Result};

pub const COMPARE_SCHEMA: &str = "nvfp4-probe.compare/1";

#[derive(Clone, Debug, Serialize)]
pub struct TraceInfo {
    pub path: String,
    pub files: Vec<String>,
    pub ranks: usize,
    pub passes: usize,
    pub names: String,
    pub rows: Option<Vec<usize>>,
    pub token_source: String,
}

#[derive(Clone, Debug, Serialize, Default)]
pub struct CompareSummary {
    pub compared: usize,
    pub divergent: usize,
    pub first_divergent: Option<String>,
    pub first_divergent_reason: Option<String>,
    pub first_divergent_hint: Option<String>,
    /// Which checkpoint scale explains the first divergence (None: not attributed).
    pub attribution: Option<String>,
    /// Every divergent op the checkpoint explains (the served emulation diverges there too and a
    /// scale hypothesis restores it): (op, bisect's verdict).
    pub attributions: Vec<(String, String)>,
    pub unmapped: Vec<String>,
    /// Trace tensors that could not be compared (shape not reconcilable with the op), with why.
    pub skipped: Vec<Skipped>,
    /// The precision the run computed at (the coarsest its computed outputs carry).
    pub run_precision: String,
    /// Compared ops per precision they were held to.
    pub held_at: std::collections::BTreeMap<String, usize>,
    pub notes: Vec<String>,
}

/// Everything `compare` measured.
#[derive(Clone, Debug, Serialize)]
pub struct CompareReport {
    pub schema: &'static str,
    pub meta: RunMeta,
    pub trace: TraceInfo,
    pub summary: CompareSummary,
    pub ops: Vec<OpCompare>,
}

fn fmt(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.2e}")).unwrap_or_else(|| "—".into())
}

fn cos(x: Option<f64>) -> String {
    x.map(|v| format!("{v:.6}")).unwrap_or_else(|| "—".into())
}

/// `bf16` or `bf16 (values f32)` when the values carry a finer precision than the op is held to.
fn held(o: &OpCompare) -> String {
    match (o.held_at, o.carried) {
        (Some(h), Some(c)) if h != c => format!("{} (values {})", h.name(), c.name()),
        (Some(h), _) => h.name().into(),
        _ => "—".into(),
    }
}

/// The oracle an op's verdict is judged against: the one with the smaller rel-L2 (the verdict
/// holds the better of the two to the tolerance; `trace::compare`).
fn judged(o: &OpCompare) -> (&'static str, &crate::metrics::Compare) {
    match (o.vs_fp32.rel_l2, o.vs_bf16.rel_l2) {
        (Some(a), Some(b)) if a < b => ("fp32", &o.vs_fp32),
        (Some(_), None) => ("fp32", &o.vs_fp32),
        _ => ("bf16", &o.vs_bf16),
    }
}

/// `bf16`, `bf16*` when the values carry a finer precision than the op is held to (the legend
/// says so; the markdown report spells it out).
fn held_short(o: &OpCompare) -> String {
    match (o.held_at, o.carried) {
        (Some(h), Some(c)) if h != c => format!("{}*", h.name()),
        (Some(h), _) => h.name().into(),
        _ => "—".into(),
    }
}

/// The terminal table within `width` columns: per op the engine's tensor (long names broken at
/// their dots), amax, NaN/Inf (a column only when some op has them), cosine and rel-L2 against
/// the oracle the verdict judges by (the closer one; both are in --json and --markdown), the
/// tolerance, the precision the op is held to and the verdict. [`legend`] explains it.
pub fn terminal_table(r: &CompareReport, width: usize) -> String {
    use crate::output::term::{cell_width, spare, wrap_name};
    let nan = r.ops.iter().any(|o| o.stats.nan + o.stats.inf > 0);
    let rows: Vec<Vec<(String, Option<Color>)>> = r
        .ops
        .iter()
        .map(|o| {
            let (which, c) = judged(o);
            let (cs, rl, vs) = match &o.agreement {
                Some(a) => (
                    format!("agree {:.3}", a.vs_fp32.max(a.vs_bf16)),
                    String::new(),
                    String::new(),
                ),
                None => (cos(c.cos), fmt(c.rel_l2), which.to_string()),
            };
            let mut row = vec![
                (o.op.clone(), None),
                (o.trace_name.clone(), None),
                (format!("{:.2e}", o.stats.amax), None),
            ];
            if nan {
                let n = o.stats.nan + o.stats.inf;
                row.push((n.to_string(), (n > 0).then_some(Color::Red)));
            }
            row.extend([
                (cs, None),
                (rl, None),
                (vs, None),
                (format!("{:.1e}", o.tolerance), None),
                (held_short(o), None),
                (
                    o.verdict.clone(),
                    Some(if o.diverges() {
                        Color::Red
                    } else {
                        Color::Green
                    }),
                ),
            ]);
            row
        })
        .collect();
    let mut header = vec!["op", "engine tensor", "amax"];
    if nan {
        header.push("NaN");
    }
    header.extend(["cos", "rel-L2", "vs", "tol", "held\nat", "verdict"]);
    // the engine's names take what the other columns leave (at least 16 characters)
    let others: Vec<usize> = (0..header.len())
        .filter(|&i| i != 1)
        .map(|i| {
            rows.iter()
                .map(|r| cell_width(&r[i].0))
                .chain([cell_width(header[i])])
                .max()
                .unwrap_or(0)
        })
        .collect();
    let name_max = spare(width, &others).max(16);
    let mut t = crate::output::term::table(width);
    t.set_header(header);
    for row in rows {
        t.add_row(
            row.into_iter()
                .enumerate()
                .map(|(i, (text, color))| {
                    let text = if i == 1 {
                        wrap_name(&text, name_max)
                    } else {
                        text
                    };
                    match color {
                        Some(c) => Cell::new(text).fg(c),
                        None => Cell::new(text),
                    }
                })
                .collect::<Vec<_>>(),
        );
    }
    t.to_string()
}

/// The line under the terminal table: what its columns say.
pub fn legend() -> &'static str {
    "cos, rel-L2: the engine's values against the oracle the verdict judges them by (vs: the closer of the FP32 and \
BF16 oracles; both in --json and --markdown); agree: the fraction of selected indices equal to the oracle's; tol: \
the op's tolerance for that rel-L2; held at: the precision the op is held to (* its values carry a finer one, \
e.g. a BF16 run stored as F32)"
}

pub fn summary_lines(r: &CompareReport) -> Vec<String> {
    let s = &r.summary;
    let mut v = Vec::new();
    match &s.first_divergent {
        Some(op) => {
            v.push(format!(
                "first divergent op: {op} ({}); {} of {} compared ops diverge",
                s.first_divergent_reason.as_deref().unwrap_or(""),
                s.divergent,
                s.compared
            ));
            if let Some(h) = &s.first_divergent_hint {
                v.push(format!("hint: {h}"));
            }
            v.push(match &s.attribution {
                Some(a) => format!("scale attribution: {a}"),
                None => "scale attribution: the checkpoint does not explain it (the served emulation agrees with the oracle there, or no scale hypothesis restores the op)".into(),
            });
            for (op, a) in &s.attributions {
                if Some(op) != s.first_divergent.as_ref() {
                    v.push(format!("scale attribution at {op}: {a}"));
                }
            }
        }
        None => v.push(format!(
            "clean: all {} compared ops within the noise of the precision each is held to",
            s.compared
        )),
    }
    v.push(format!(
        "precision: the run computed at {} (the coarsest its computed outputs carry); ops held to {}",
        s.run_precision,
        s.held_at
            .iter()
            .map(|(p, n)| format!("{p} noise: {n}"))
            .collect::<Vec<_>>()
            .join(", ")
    ));
    for k in &s.skipped {
        v.push(format!(
            "skipped: {} (op {}): {}",
            k.trace_name, k.op, k.reason
        ));
    }
    if !s.unmapped.is_empty() {
        let shown: Vec<&str> = s.unmapped.iter().take(12).map(String::as_str).collect();
        v.push(format!(
            "unmapped ({}): {}{}",
            s.unmapped.len(),
            shown.join(", "),
            if s.unmapped.len() > 12 { ", …" } else { "" }
        ));
    }
    for n in &s.notes {
        v.push(format!("note: {n}"));
    }
    v
}

pub fn markdown(r: &CompareReport) -> String {
    let mut m = String::new();
    m.push_str("# nvfp4-probe compare\n\n");
    m.push_str(&format!(
        "- checkpoint: `{}`\n- trace: `{}` ({} file(s), {} rank(s), {} pass(es), names `{}`)\n- tokens: {} ({})\n\n",
        r.meta.checkpoint.location,
        r.trace.path,
        r.trace.files.len(),
        r.trace.ranks,
        r.trace.passes,
        r.trace.names,
        r.meta.tokens.count,
        r.trace.token_source
    ));
    for l in summary_lines(r) {
        m.push_str(&format!("**{l}**\n\n"));
    }
    m.push_str("| op | trace tensor | dtype | held at | amax | NaN | cos vs fp32 | rel-L2 vs fp32 | cos vs bf16 | rel-L2 vs bf16 | tolerance | verdict |\n");
    m.push_str("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for o in &r.ops {
        m.push_str(&format!(
            "| `{}` | `{}` | {} | {} | {:.3e} | {} | {} | {} | {} | {} | {:.1e} | {}{} |\n",
            o.op,
            o.trace_name,
            o.dtype,
            held(o),
            o.stats.amax,
            o.stats.nan + o.stats.inf,
            cos(o.vs_fp32.cos),
            fmt(o.vs_fp32.rel_l2),
            cos(o.vs_bf16.cos),
            fmt(o.vs_bf16.rel_l2),
            o.tolerance,
            if o.diverges() { "**" } else { "" },
            if o.diverges() {
                format!("{}**", o.verdict)
            } else {
                o.verdict.clone()
            }
        ));
    }
    m
}

/// Run the comparison and return the report (the command prints and writes it).
pub fn compare(args: &CompareArgs) -> Result<CompareReport> {
    let map = NameMap::from_arg(&args.names)?;
    let trace = Trace::open(&args.trace)?;
    let trace_tokens = trace.tokens()?;
    let rows = trace.rows()?;
    let opts_given = token_options_given(&args.tokens);
    let mut p = prepare(
        args.model.as_deref(),
        None,
        &args.tokens,
        None,
        None,
        BackendChoice::Auto,
        &[],
        args.seed,
        &args.mem,
        &Default::default(),
    )?;
    let token_source = match &trace_tokens {
        Some(tt) => {
            if opts_given && p.opts.tokens != tt.ids {
                return Err(Error::usage(format!(
                    "the trace's input_ids ({} tokens) differ from the token options ({} tokens)",
                    tt.ids.len(),
                    p.opts.tokens.len()
                )));
            }
            p.opts.tokens = tt.ids.clone();
            p.meta.tokens = report::token_fingerprint(&tt.ids, "trace input_ids");
            "trace input_ids".to_string()
        }
        None => {
            if !opts_given {
                return Err(Error::bad(
                    &args.trace,
                    Some("input_ids"),
                    "the trace has no input_ids; give the tokens it ran: --tokens FILE, --token-ids IDS, --prompt TEXT, or --seq-len N for the synthetic ids of a `run` without token options (--seq-len 64 by default)",
                ));
            }
            p.meta.tokens.source.clone()
        }
    };
    let cfg = p.ckpt.model_config()?.clone();
    let mapping = assemble(&trace, &map, &cfg)?;
    if mapping.ops.is_empty() {
        return Err(Error::bad(
            &args.trace,
            None,
            format!(
                "no tensor maps to an op with --names {} ({} unmapped, e.g. {})",
                map.label(),
                mapping.unmapped.len(),
                mapping
                    .unmapped
                    .iter()
                    .take(3)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let (max_layer, head) = needed_layers(&mapping);
    let nl = cfg.num_hidden_layers;
    let last = if head { nl - 1 } else { max_layer.unwrap_or(0) };
    if last >= nl {
        return Err(Error::bad(
            &args.trace,
            None,
            format!("the trace has layer {last}; the model has {nl} layers"),
        ));
    }
    p.opts.layers = (0, last);
    p.meta.layers = [0, last];
    p.opts.keep_outputs = true;
    let (res, caps) = probe::run_capturing(&p.ckpt, &p.opts, true)?;
    p.meta.seconds = res.seconds;
    p.meta.bytes_read = res.bytes_read;
    let with_head = last + 1 == nl && p.ckpt.resolve("head.weight").is_some();
    let order: Vec<String> = build_graph(&cfg, last, with_head)
        .iter()
        .flat_map(|o| o.outputs.clone())
        .collect();
    let ev = evaluate(&Inputs {
        res: &res,
        mapping: &mapping,
        tokens: trace_tokens.as_ref(),
        rows: rows.as_deref(),
        thresholds: &p.opts.spec.thresholds,
        trace_path: &args.trace,
        order: &order,
    })?;
    let ops = ev.ops;
    let first = ops.iter().find(|o| o.diverges());
    let mut notes = mapping.notes.clone();
    if trace.ranks > 1 {
        notes.push(format!("{} tensor-parallel ranks joined", trace.ranks));
    }
    let divergent_ops: Vec<&str> = ops
        .iter()
        .filter(|o| o.diverges())
        .map(|o| o.op.as_str())
        .collect();
    let attrs = if divergent_ops.is_empty() {
        Vec::new()
    } else {
        attributions(&p.ckpt, &p.opts, &res, caps, &divergent_ops)
    };
    let mut held_at = std::collections::BTreeMap::new();
    for o in &ops {
        if let Some(h) = o.held_at {
            *held_at.entry(h.name().to_string()).or_insert(0) += 1;
        }
    }
    let summary = CompareSummary {
        compared: ops.len(),
        divergent: divergent_ops.len(),
        first_divergent: first.map(|o| o.op.clone()),
        first_divergent_reason: first.and_then(|o| o.reason.clone()),
        first_divergent_hint: first.and_then(|o| o.hint.clone()),
        attribution: first.and_then(|o| {
            attrs
                .iter()
                .find(|(op, _)| *op == o.op)
                .map(|(_, v)| v.clone())
        }),
        attributions: attrs,
        unmapped: mapping.unmapped.clone(),
        skipped: ev.skipped,
        run_precision: ev.run_precision.name().into(),
        held_at,
        notes,
    };
    Ok(CompareReport {
        schema: COMPARE_SCHEMA,
        meta: p.meta,
        trace: TraceInfo {
            path: args.trace.display().to_string(),
            files: trace
                .files
                .iter()
                .map(|f| f.path.display().to_string())
                .collect(),
            ranks: trace.ranks,
            passes: trace.passes,
            names: map.label().into(),
            rows,
            token_source,
        },
        summary,
        ops,
    })
}

pub fn main(args: &CompareArgs) -> Result<i32> {
    // the model directory (its shards' real directories), the trace and the input files are
    // never written
    let mut guard = super::run::guard(args.model.as_deref(), None, &[&args.tokens.tokens])
        .input(&args.trace, "the trace");
    let names = std::path::Path::new(&args.names);
    if names.exists() {
        guard = guard.input(names, "the name map");
    }
    let mut outs = Outputs::new(guard);
    for out in [&args.json, &args.markdown].into_iter().flatten() {
        outs.check(out)?;
    }
    let r = compare(args)?;
    let width = crate::output::term::width();
    let mut text = terminal_table(&r, width);
    text.push('\n');
    text.push_str(legend());
    text.push('\n');
    for l in summary_lines(&r) {
        text.push_str(&l);
        text.push('\n');
    }
    print!("{}", crate::output::term::fit(&text, width));
    if let Some(j) = &args.json {
        let s = serde_json::to_string_pretty(&r)
            .map_err(|e| Error::usage(format!("compare JSON: {e}")))?;
        outs.file(j, s.as_bytes())?;
    }
    if let Some(md) = &args.markdown {
        outs.file(md, markdown(&r).as_bytes())?;
    }
    outs.publish_and_report()?;
    Ok(if r.summary.divergent > 0 {
        EXIT_FINDINGS
    } else {
        EXIT_OK
    })
}

/// Whether any token option was given (they must then name the trace's tokens).
pub fn token_options_given(t: &TokenArgs) -> bool {
    t.token_ids.is_some() || t.tokens.is_some() || t.prompt.is_some() || t.seq_len.is_some()
}
