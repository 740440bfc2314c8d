//! Reports read run results and nothing else: the terminal table, the markdown report, the run
//! JSON (`nvfp4-probe.run/1`, documented in docs/json-schema.md) and `--dump` safetensors.

use std::path::{Path, PathBuf};

use comfy_table::{Cell, Color};
use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::checkpoint::Checkpoint;
use crate::metrics::Compare;
use crate::output::Outputs;
use crate::probe::spec::Thresholds;
use crate::probe::{OpRecord, RunResult, Summary};
use crate::{Error, Result};

pub use crate::run_json::RUN_SCHEMA;

#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct CheckpointFingerprint {
    pub location: String,
    pub naming: String,
    /// sha256 of config.json as parsed and re-serialized with sorted keys.
    pub config_sha256: String,
    /// sha256 over every tensor's (name, dtype, shape), sorted by name.
    pub header_sha256: String,
}

#[derive(Clone, Debug, Serialize, serde::Deserialize, PartialEq)]
pub struct TokenFingerprint {
    pub count: usize,
    /// sha256 of the ids as little-endian u32.
    pub sha256: String,
    pub source: String,
}

/// Everything about a run that is not a per-op number.
#[derive(Clone, Debug, Serialize)]
pub struct RunMeta {
    pub tool: String,
    pub version: String,
    pub backend: String,
    pub device: String,
    pub checkpoint: CheckpointFingerprint,
    pub tokens: TokenFingerprint,
    pub probe: crate::probe::spec::ProbeSpec,
    pub served_profile: String,
    pub loader_faults: Vec<String>,
    /// `--served-chunk`: the served path prefilled in chunks of this many tokens.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub served_chunk: Option<usize>,
    /// `--engine-fault`s at those chunks' boundaries.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engine_faults: Vec<String>,
    pub layers: [usize; 2],
    pub seconds: f64,
    pub bytes_read: u64,
}

#[derive(Serialize)]
struct RunJson<'a> {
    schema: &'static str,
    #[serde(flatten)]
    meta: &'a RunMeta,
    summary: &'a Summary,
    ops: &'a [OpRecord],
}

fn hex(d: impl AsRef<[u8]>) -> String {
    d.as_ref().iter().map(|b| format!("{b:02x}")).collect()
}

pub fn checkpoint_fingerprint(ckpt: &Checkpoint) -> CheckpointFingerprint {
    let cfg = serde_json::to_string(ckpt.config_json()).unwrap_or_default();
    let mut names = ckpt.tensor_names();
    names.sort();
    let mut h = Sha256::new();
    for n in &names {
        if let Some(i) = ckpt.info(n) {
            h.update(format!("{n}\t{:?}\t{:?}\n", i.dtype, i.shape).as_bytes());
        }
    }
    CheckpointFingerprint {
        location: ckpt.location().display().to_string(),
        naming: format!("{:?}", ckpt.naming()),
        config_sha256: hex(Sha256::digest(cfg.as_bytes())),
        header_sha256: hex(h.finalize()),
    }
}

pub fn token_fingerprint(tokens: &[u32], source: &str) -> TokenFingerprint {
    let mut h = Sha256::new();
    for t in tokens {
        h.update(t.to_le_bytes());
    }
    TokenFingerprint {
        count: tokens.len(),
        sha256: hex(h.finalize()),
        source: source.to_string(),
    }
}

pub fn run_json(meta: &RunMeta, res: &RunResult) -> String {
    serde_json::to_string_pretty(&RunJson {
        schema: RUN_SCHEMA,
        meta,
        summary: &res.summary,
        ops: &res.records,
    })
    .expect("run JSON serializes")
}

fn fmt_g(x: f64) -> String {
    if x == 0.0 {
        "0".into()
    } else if x.abs() >= 1e4 || x.abs() < 1e-3 {
        format!("{x:.3e}")
    } else {
        format!("{x:.4}")
    }
}

fn fmt_cos(c: &Compare) -> String {
    match c.cos {
        Some(v) if (0.99995..1.0).contains(&v) => format!("{v:.6}"),
        Some(v) => format!("{v:.4}"),
        None => "NaN".into(),
    }
}

fn nan_cell(r: &OpRecord) -> String {
    let s = &r.stats["served"];
    if s.nan + s.inf == 0 {
        "0".into()
    } else if s.inf == 0 {
        format!("{}", s.nan)
    } else {
        format!("{}+{}inf", s.nan, s.inf)
    }
}

fn verdict(r: &OpRecord) -> &'static str {
    if r.divergent {
        "DIVERGES"
    } else if r.shows {
        "shows"
    } else {
        ""
    }
}

fn health_cell(r: &OpRecord) -> String {
    match &r.health {
        Some(h) if h.blocks > 0 => {
            let pct = |x: u64, of: u64| 100.0 * x as f64 / of.max(1) as f64;
            format!(
                "0x00 {:.1}% 0x7E {:.1}% clip {:.2}% dead {:.1}%",
                pct(h.scale_zero, h.blocks),
                pct(h.scale_max, h.blocks),
                pct(h.clipped, h.elements),
                pct(h.dead_zone, h.elements)
            )
        }
        _ => String::new(),
    }
}

/// The terminal table (comfy-table; red marks NaN and divergence), laid out within `width`
/// columns (`output::term`). Cosine and rel-L2 columns are the served path against the BF16
/// oracle; ops that pick indices (the indexer) have no cosine: their `agree` column is the
/// fraction of the served path's selections equal to the BF16 oracle's, isolated / propagated.
/// The op's step is its row (the markdown report and the JSON carry it). [`legend`] explains the
/// abbreviations and the status column.
pub fn terminal_table(res: &RunResult, width: usize) -> String {
    let mut t = crate::output::term::table(width);
    let agree = res.records.iter().any(|r| r.agreement.is_some());
    let mut header = vec![
        "op",
        "amax\nfp32",
        "amax\nserved",
        "NaN",
        "cos\niso",
        "cos\nprop",
        "rel-L2\niso",
        "tol",
    ];
    if agree {
        header.push("agree\niso/prop");
    }
    header.push("status");
    t.set_header(header);
    for r in &res.records {
        let nan = nan_cell(r);
        let v = verdict(r);
        let mut row = vec![
            Cell::new(&r.id),
            Cell::new(fmt_g(r.stats["oracle_fp32"].amax)),
            Cell::new(fmt_g(r.stats["served"].amax)),
            if nan != "0" {
                Cell::new(nan).fg(Color::Red)
            } else {
                Cell::new(nan)
            },
        ];
        match &r.agreement {
            Some(_) => row.extend([Cell::new(""), Cell::new(""), Cell::new("")]),
            None => row.extend([
                Cell::new(fmt_cos(&r.served_isolated_vs_bf16)),
                Cell::new(fmt_cos(&r.served_propagated_vs_bf16)),
                Cell::new(
                    r.served_isolated_vs_bf16
                        .rel_l2
                        .map(fmt_g)
                        .unwrap_or("NaN".into()),
                ),
            ]),
        }
        row.push(Cell::new(fmt_g(r.tolerance)));
        if agree {
            row.push(Cell::new(match &r.agreement {
                Some(a) => format!("{:.3}/{:.3}", a.served_isolated, a.served_propagated),
                None => String::new(),
            }));
        }
        row.push(match v {
            "DIVERGES" => Cell::new(v).fg(Color::Red),
            "shows" => Cell::new(v).fg(Color::Yellow),
            _ => Cell::new(v),
        });
        t.add_row(row);
    }
    t.to_string()
}

/// The line under the terminal table: its abbreviations and what the status column says, with
/// the run's thresholds (the decisions are made in `probe::record` from
/// `probe::spec::Thresholds`). One line; the terminal output wraps it at its width.
pub fn legend(th: &Thresholds) -> String {
    format!(
        "iso = isolated (the served op fed the BF16 oracle's inputs: its own error), prop = propagated (fed its own inputs); \
cos and rel-L2 against the BF16 oracle; tol = the op's tolerance for the isolated rel-L2; agree = the indexer's selections equal to the BF16 oracle's. \
status: DIVERGES = this op alone is off (isolated rel-L2 > tol, amax off by more than {}x, or NaN/Inf the oracle has not); \
shows = error carried in from earlier ops is visible here (propagated rel-L2 > {})",
        th.amax_ratio, th.propagated_rel_l2
    )
}

/// One-paragraph summary for the terminal and the markdown report.
pub fn summary_lines(res: &RunResult) -> Vec<String> {
    let s = &res.summary;
    let mut v = Vec::new();
    match (&s.first_divergent, &s.first_divergent_reason) {
        (Some(op), Some(why)) => v.push(format!(
            "first divergent op (isolated): {op} — {why} ({} divergent ops)",
            s.divergent_ops
        )),
        _ => v.push("no op diverges beyond its tolerance (isolated)".into()),
    }
    match &s.first_shows {
        Some(op) => v.push(format!("error first visible (propagated): {op}")),
        None => v.push("propagated error stays below the visibility threshold".into()),
    }
    match &s.first_non_finite {
        Some((paths, op)) => v.push(format!(
            "first NaN/Inf: {op} (path {paths}); {} ops with non-finite values",
            s.non_finite_ops
        )),
        None => v.push("no NaN/Inf on any path".into()),
    }
    if let Some(h) = res.records.iter().rev().find_map(|r| r.head.as_ref()) {
        v.push(head_line(h));
    }
    v
}

/// The model's output in one line: served vs the BF16 oracle, and the oracle's own spread.
pub fn head_line(h: &crate::probe::HeadMetrics) -> String {
    let (s, n) = (&h.head_served_vs_bf16, &h.head_bf16_vs_fp32);
    let kl = |k: Option<f64>| k.map_or("undefined".into(), |k| format!("{k:.2e}"));
    format!(
        "model output (head): served vs BF16 oracle next-token top-1 agreement {:.1} %, top-5 {:.1} %, KL {} nats (max {}{}); BF16 vs FP32 oracle: top-1 {:.1} %, KL {}{}",
        s.top1 * 100.0,
        s.top5 * 100.0,
        kl(s.kl),
        kl(s.kl_max),
        s.kl_max_at.map_or(String::new(), |p| format!(" at position {p}")),
        n.top1 * 100.0,
        kl(n.kl),
        s.first_top1_change
            .map_or(String::new(), |p| format!("; first top-1 change at position {p}"))
    )
}

/// The markdown sections of what the run measured beyond the op table: the model's output per
/// position, and the routed experts one by one (divergent and unreached ones named).
pub fn output_and_experts_markdown(res: &RunResult) -> String {
    let mut m = String::new();
    if let Some(h) = res.records.iter().rev().find_map(|r| r.head.as_ref()) {
        m.push_str("\n## Model output\n\n");
        m.push_str(&format!("{}\n\n", head_line(h)));
        m.push_str("| position | KL (nats) | top-1 agrees | top-5 overlap | served token | BF16 oracle token |\n|---:|---:|---|---:|---:|---:|\n");
        const SHOWN: usize = 64;
        for (i, p) in h.head_positions.iter().enumerate().take(SHOWN) {
            m.push_str(&format!(
                "| {i} | {} | {} | {:.2} | {} | {} |\n",
                p.kl.map_or("NaN".into(), fmt_g),
                if p.top1 { "yes" } else { "**no**" },
                p.top5,
                p.token,
                p.reference_token
            ));
        }
        if h.head_positions.len() > SHOWN {
            m.push_str(&format!(
                "\n({} more positions in the run JSON's `head_positions`)\n",
                h.head_positions.len() - SHOWN
            ));
        }
    }
    let with_experts: Vec<&OpRecord> = res.records.iter().filter(|r| r.experts.is_some()).collect();
    if !with_experts.is_empty() {
        m.push_str("\n## Routed experts, one by one\n\nEach expert's served output on the rows routed to it against the BF16 oracle's (both fed the oracle's inputs); its tolerance is the op's widened by 1/√rows.\n\n| Op | experts reached | divergent experts | worst expert (rel-L2 / tolerance, rows) | unreached |\n|---|---:|---|---|---|\n");
        for r in with_experts {
            let ex = r.experts.as_deref().unwrap_or(&[]);
            let bad: Vec<String> = ex
                .iter()
                .filter(|e| e.divergent)
                .map(|e| e.expert.to_string())
                .collect();
            let worst = ex
                .iter()
                .filter(|e| e.rows > 0)
                .max_by(|a, b| {
                    let q = |e: &crate::probe::experts::ExpertRecord| {
                        e.rel_l2.unwrap_or(f64::INFINITY) / e.tolerance
                    };
                    q(a).total_cmp(&q(b))
                })
                .map_or(String::new(), |e| {
                    format!(
                        "{}: {} / {} ({})",
                        e.expert,
                        e.rel_l2.map_or("NaN".into(), fmt_g),
                        fmt_g(e.tolerance),
                        e.rows
                    )
                });
            let unreached = r.experts_unreached.as_deref().unwrap_or(&[]);
            m.push_str(&format!(
                "| `{}` | {} | {} | {} | {} |\n",
                r.id,
                ex.iter().filter(|e| e.rows > 0).count(),
                if bad.is_empty() {
                    "none".to_string()
                } else {
                    format!("**{}**", bad.join(", "))
                },
                worst,
                if unreached.is_empty() {
                    "none".to_string()
                } else {
                    format!(
                        "{} ({})",
                        unreached.len(),
                        unreached
                            .iter()
                            .take(16)
                            .map(|e| e.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    )
                }
            ));
        }
    }
    m
}

/// The markdown report: what was run, the summary (the first divergent op, where error shows,
/// NaN/Inf), the findings (`res.summary.findings`, ordered by consequence), then the tables: the
/// per-op table people paste into issues and the details.
pub fn markdown(meta: &RunMeta, res: &RunResult) -> String {
    let mut m = String::new();
    m.push_str("# nvfp4-probe run\n\n");
    m.push_str(&format!(
        "checkpoint `{}` ({}), layers {}..{}, {} tokens, served profile `{}`{}, backend {}\n\n",
        meta.checkpoint.location,
        meta.checkpoint.naming,
        meta.layers[0],
        meta.layers[1],
        meta.tokens.count,
        meta.served_profile,
        if meta.loader_faults.is_empty() {
            String::new()
        } else {
            format!(", loader faults {}", meta.loader_faults.join(" "))
        },
        meta.backend
    ));
    for l in summary_lines(res) {
        m.push_str(&format!("- {l}\n"));
    }
    m.push('\n');
    m.push_str(&crate::probe::findings::markdown(
        res.summary.findings.as_deref().unwrap_or(&[]),
    ));
    m.push_str(
        "\n## Ops\n\n| Step | Op | amax | NaN | cos vs BF16 oracle |\n|---:|---|---:|---:|---:|\n",
    );
    for r in &res.records {
        let cos = match &r.agreement {
            Some(a) => format!("agree {:.3}", a.served_propagated),
            None => fmt_cos(&r.served_propagated_vs_bf16),
        };
        let flag = if r.divergent { " **diverges**" } else { "" };
        m.push_str(&format!(
            "| {} | `{}`{} | {} | {} | {} |\n",
            r.step,
            r.id,
            flag,
            fmt_g(r.stats["served"].amax),
            nan_cell(r),
            cos
        ));
    }
    m.push_str("\namax and NaN are the served path's; cosine is served (propagated) against the BF16 oracle.\n");
    m.push_str(&output_and_experts_markdown(res));
    m.push_str("\n## Details\n\n| Op | amax fp32 | amax bf16 | amax served | noise rel-L2 (bf16 vs fp32, isolated) | isolated rel-L2 | isolated cos | tolerance | NVFP4 activation health | act amax / calib | verdict |\n|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---|\n");
    for r in &res.records {
        m.push_str(&format!(
            "| `{}` | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |\n",
            r.id,
            fmt_g(r.stats["oracle_fp32"].amax),
            fmt_g(r.stats["oracle_bf16"].amax),
            fmt_g(r.stats["served"].amax),
            r.bf16_vs_fp32_isolated
                .rel_l2
                .map(fmt_g)
                .unwrap_or("NaN".into()),
            r.served_isolated_vs_bf16
                .rel_l2
                .map(fmt_g)
                .unwrap_or("NaN".into()),
            fmt_cos(&r.served_isolated_vs_bf16),
            fmt_g(r.tolerance),
            health_cell(r),
            r.act_amax_over_calib.map(fmt_g).unwrap_or_default(),
            r.reason.clone().unwrap_or_else(|| verdict(r).to_string())
        ));
    }
    m
}

/// `--dump DIR`: one safetensors file per path with each reported op's output as F32 under its
/// op id and the run's token ids as `input_ids` (I64, what `compare` reads from an engine's
/// trace), staged in `outs` (DIR is created when the outputs are published). With `--dump-rows`
/// the metadata `token_rows` (and `rows`, the name `compare` reads) lists the rows kept.
pub fn dump(
    outs: &mut Outputs,
    dir: &Path,
    res: &RunResult,
    tokens: &[u32],
) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let ids: Vec<u8> = tokens
        .iter()
        .flat_map(|&t| i64::from(t).to_le_bytes())
        .collect();
    for (path, ops) in &res.outputs {
        let bufs: Vec<(String, Vec<usize>, Vec<u8>)> = ops
            .iter()
            .map(|(id, t)| {
                (
                    id.clone(),
                    t.shape.clone(),
                    t.data.iter().flat_map(|v| v.to_le_bytes()).collect(),
                )
            })
            .collect();
        let mut views: Vec<(String, safetensors::tensor::TensorView)> = bufs
            .iter()
            .map(|(id, shape, b)| {
                (
                    id.clone(),
                    safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                        .expect("shape matches data"),
                )
            })
            .collect();
        if !ops.iter().any(|(id, _)| id == "input_ids") {
            views.push((
                "input_ids".into(),
                safetensors::tensor::TensorView::new(
                    safetensors::Dtype::I64,
                    vec![tokens.len()],
                    &ids,
                )
                .expect("shape matches data"),
            ));
        }
        // which token rows the tensors hold (`--dump-rows`; `probe::runner::kept_rows`)
        let meta = res.kept_rows.as_ref().map(|rows| {
            let list: Vec<String> = rows.iter().map(|r| r.to_string()).collect();
            let list = list.join(",");
            std::collections::HashMap::from([
                ("token_rows".to_string(), list.clone()),
                ("rows".to_string(), list),
            ])
        });
        let bytes = safetensors::serialize(views, meta)
            .map_err(|e| Error::usage(format!("dump {path}: {e}")))?;
        let p = dir.join(format!("{path}.safetensors"));
        outs.file(&p, &bytes)?;
        written.push(p);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The status column has a header; indexer rows show agreement in its own column and no
    /// cosine; the legend states the run's thresholds.
    #[test]
    fn table_has_a_status_header_and_keeps_agreement_out_of_the_cosine_columns() {
        let ck = crate::synth::builtin(0).expect("built-in model");
        let cfg = ck.model_config().expect("config").clone();
        let tokens = crate::probe::synthetic_tokens(16, cfg.vocab_size, 1);
        let res =
            crate::probe::run(&ck, &crate::probe::RunOptions::new((0, 2), tokens)).expect("run");
        assert!(
            res.records.iter().any(|r| r.agreement.is_some()),
            "no indexer op"
        );
        let t = terminal_table(&res, 120);
        let rows: Vec<Vec<String>> = t
            .lines()
            .filter(|l| l.starts_with('│'))
            .map(|l| {
                l.trim_matches('│')
                    .split('┆')
                    .map(|c| c.trim().to_string())
                    .collect()
            })
            .collect();
        for l in t.lines() {
            assert!(l.chars().count() <= 120, "{l}");
        }
        // the header's two lines joined: `cos` over `iso` is `cos iso`
        let head: Vec<String> = rows[0]
            .iter()
            .zip(&rows[1])
            .map(|(a, b)| format!("{a} {b}").trim().to_string())
            .collect();
        assert_eq!(head.last().map(String::as_str), Some("status"), "{head:?}");
        let col = |name: &str| head.iter().position(|h| h == name).expect(name);
        let (cos_iso, cos_prop, agree) = (col("cos iso"), col("cos prop"), col("agree iso/prop"));
        assert_eq!(rows.len(), 2 + res.records.len(), "one line per op");
        for (row, r) in rows[2..].iter().zip(&res.records) {
            assert_eq!(row[0], r.id);
            match &r.agreement {
                Some(a) => {
                    assert!(
                        row[cos_iso].is_empty() && row[cos_prop].is_empty(),
                        "{row:?}"
                    );
                    let want = format!("{:.3}/{:.3}", a.served_isolated, a.served_propagated);
                    assert_eq!(row[agree], want);
                }
                None => {
                    assert!(row[agree].is_empty(), "{row:?}");
                    assert!(row[cos_iso].parse::<f64>().is_ok(), "{row:?}");
                }
            }
        }
        let th = Thresholds {
            propagated_rel_l2: 0.7,
            amax_ratio: 3.0,
            ..Thresholds::default()
        };
        let l = legend(&th);
        assert!(!l.contains('\n'));
        assert!(l.contains("> 0.7") && l.contains("more than 3x"), "{l}");
    }
}
