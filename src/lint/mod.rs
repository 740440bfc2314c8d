//! `lint`: find broken scales before anything runs.
//!
//! Lint reads headers, scalar scales, block-scale bytes and, for rows whose scales are all zero,
//! that one row of packed data — never a whole packed weight — because its point is to be run
//! on a 256-expert layer in seconds, before a GPU is ever allocated. Faults that the
//! checkpoint's own scales hide (nibble order, shifted scale rows, a consistently rescaled
//! tensor) need a second opinion: `--reference` dequantises both checkpoints one tensor pair at
//! a time and names the cause from the ratio pattern.

mod catalogue;
mod checks;
mod config;
mod degenerate;
mod fused;
pub mod group;
pub mod layout;
mod output;
pub mod reference;
pub mod rules;
mod sample;
pub mod wiring;

use std::path::{Path, PathBuf};
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use crate::checkpoint::{Checkpoint, WeightMeta};
use crate::error::{EXIT_FINDINGS, EXIT_OK};
use crate::served::faults::op_of_base;
use crate::Result;

pub use rules::{RuleInfo, Rules, Severity, Thresholds, RULES};

/// JSON schema tag of `--json`.
pub const SCHEMA: &str = "nvfp4-probe.lint/1";

/// One finding. `tensor` is the raw (checkpoint) name; `op` the op id the weight feeds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Finding {
    pub rule: String,
    pub severity: Severity,
    pub tensor: String,
    pub file: String,
    pub op: Option<String>,
    pub evidence: String,
    pub fix: String,
    /// Set when the finding's effect is provably absorbed downstream: the op that removes it (a
    /// warning, an error under `--strict`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub absorbed_by: Option<String>,
}

/// Everything one lint run found.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: PathBuf,
    pub reference: Option<PathBuf>,
    pub weights: usize,
    /// Bytes of tensor data read (scales, scalars, sampled rows; both checkpoints with --reference).
    pub bytes_read: u64,
    pub seconds: f64,
    pub findings: Vec<Finding>,
}

impl Report {
    pub fn count(&self, s: Severity) -> usize {
        self.findings.iter().filter(|f| f.severity == s).count()
    }

    /// 0 clean (warnings allowed), 1 when any error was found.
    pub fn exit_code(&self) -> i32 {
        if self.count(Severity::Error) > 0 {
            EXIT_FINDINGS
        } else {
            EXIT_OK
        }
    }

    /// `--strict`: findings whose effect is absorbed downstream count as errors.
    pub fn strict(&mut self) {
        for f in &mut self.findings {
            if f.absorbed_by.is_some() && f.severity < Severity::Error {
                f.severity = Severity::Error;
            }
        }
        sort(&mut self.findings);
    }

    /// Findings of one rule.
    pub fn of_rule<'a>(&'a self, rule: &'a str) -> impl Iterator<Item = &'a Finding> + 'a {
        self.findings.iter().filter(move |f| f.rule == rule)
    }
}

/// What the checks share: the checkpoint, the rules and a finding factory that applies the
/// severity overrides.
pub(crate) struct Cx<'a> {
    pub ck: &'a Checkpoint,
    pub rules: &'a Rules,
    pub sampler: sample::Sampler,
}

impl<'a> Cx<'a> {
    pub fn new(ck: &'a Checkpoint, rules: &'a Rules) -> Cx<'a> {
        Cx {
            ck,
            rules,
            sampler: sample::Sampler::default(),
        }
    }

    pub fn th(&self) -> &Thresholds {
        &self.rules.thresholds
    }

    /// A finding for weight `base` (None when the rule is switched off).
    #[allow(clippy::too_many_arguments)]
    pub fn finding(
        &self,
        rule: &str,
        default: Severity,
        tensor: &str,
        file: &Path,
        base: &str,
        evidence: String,
        fix: &str,
    ) -> Option<Finding> {
        let severity = self.rules.severity(rule, default)?;
        Some(Finding {
            rule: rule.to_string(),
            severity,
            tensor: tensor.to_string(),
            file: file.display().to_string(),
            op: op_of_base(base),
            evidence,
            fix: fix.to_string(),
            absorbed_by: None,
        })
    }
}

/// Lint an open checkpoint (no reference).
pub fn lint(ck: &Checkpoint, rules: &Rules) -> Result<Report> {
    lint_bases(ck, rules, ck.weight_bases())
}

/// The layer a (canonical or raw) tensor or base name belongs to: `layers.N.` or `model.layers.N.`.
pub fn layer_of(name: &str) -> Option<usize> {
    let i = name.find("layers.")?;
    if i > 0 && !name[..i].ends_with('.') {
        return None;
    }
    name[i + 7..].split('.').next()?.parse().ok()
}

/// Lint only what a run of layers 0..=`last` reads: the weights of those layers and those outside
/// any layer (embedding, head); findings about later layers are dropped. What `run` and `bisect`
/// check before they report (scales only: headers, scalars, block-scale bytes of those layers).
pub fn lint_layers(ck: &Checkpoint, rules: &Rules, last: usize) -> Result<Report> {
    let bases: Vec<String> = ck
        .weight_bases()
        .into_iter()
        .filter(|b| layer_of(b).is_none_or(|l| l <= last))
        .collect();
    let mut r = lint_bases(ck, rules, bases)?;
    r.findings
        .retain(|f| layer_of(&f.tensor).is_none_or(|l| l <= last));
    Ok(r)
}

fn lint_bases(ck: &Checkpoint, rules: &Rules, bases: Vec<String>) -> Result<Report> {
    let t0 = Instant::now();
    let cx = Cx::new(ck, rules);
    let per: Vec<(Vec<Finding>, Option<WeightMeta>)> = bases
        .par_iter()
        .map(|b| checks::check_weight(&cx, b))
        .collect();
    let mut findings = Vec::new();
    let mut metas = Vec::new();
    for (f, m) in per {
        findings.extend(f);
        metas.extend(m);
    }
    findings.extend(checks::cross_checks(&cx, &metas));
    findings.extend(checks::completeness(&cx));
    findings.extend(config::check_config(&cx, &metas));
    findings.extend(degenerate::config_findings(&cx));
    findings.extend(catalogue::findings(&cx, &metas));
    // plain tensors of the layers the weights belong to (and those outside any layer)
    let layers: std::collections::HashSet<usize> =
        bases.iter().filter_map(|b| layer_of(b)).collect();
    findings.extend(degenerate::tensor_findings(&cx, Some(&layers)));
    fused::fused_findings(&cx, &mut findings);
    sort(&mut findings);
    Ok(Report {
        model: ck.location().to_path_buf(),
        reference: None,
        weights: bases.len(),
        bytes_read: ck.bytes_read() + cx.sampler.bytes(),
        seconds: t0.elapsed().as_secs_f64(),
        findings,
    })
}

/// What `inspect` says on stderr about a checkpoint it can list but not fully use: an unusable
/// config (shapes are then not checked against it), a quantization config the tensors cannot
/// be checked against, tensors whose shapes contradict the config (the same detection as lint's
/// `config.model` and `config.scheme`, what `run` refuses), and tensors its layers lack (lint's
/// `weight.missing`). Returns whether the config is one `run` refuses (`inspect` then exits 2
/// after describing the tensors).
pub fn warn_incomplete(ck: &Checkpoint) -> bool {
    const SHOWN: usize = 20;
    let mut refused = false;
    if let Err(e) = ck.model_config() {
        eprintln!("warning: {e} (weights are listed without checking their shapes against it)");
        refused = true;
    }
    if let Err(u) = ck.quant_declared() {
        eprintln!("warning: {}", u.to_error());
        refused = true;
    }
    let mut shapes: Vec<String> = crate::checkpoint::shapes::shape_problems(ck)
        .iter()
        .map(|p| p.to_error().to_string())
        .collect();
    for b in ck.weight_bases() {
        if let Ok(m) = ck.weight_meta_unchecked(&b) {
            if let Err(e) = ck.check_config_shape(&m) {
                shapes.push(e.to_string());
            }
        }
    }
    refused |= !shapes.is_empty();
    for s in shapes.iter().take(SHOWN) {
        eprintln!("warning: {s}");
    }
    if shapes.len() > SHOWN {
        eprintln!(
            "warning: … and {} more tensors whose shapes contradict config.json (`nvfp4-probe lint` lists them all)",
            shapes.len() - SHOWN
        );
    }
    let missing = ck.missing_tensors();
    for m in missing.iter().take(SHOWN) {
        eprintln!(
            "warning: missing tensor `{}` ({}) in {}",
            m.tensor,
            m.what,
            m.file.display()
        );
    }
    if missing.len() > SHOWN {
        eprintln!(
            "warning: … and {} more missing tensors (`nvfp4-probe lint` lists them all)",
            missing.len() - SHOWN
        );
    }
    refused
}

/// Lint `model`, and with a reference also compare tensor by tensor.
pub fn lint_dir(model: &Path, reference: Option<&Path>, rules: &Rules) -> Result<Report> {
    let t0 = Instant::now();
    let ck = Checkpoint::open(model)?;
    let mut rep = lint(&ck, rules)?;
    if let Some(rdir) = reference {
        let rck = Checkpoint::open(rdir)?;
        let f = reference::compare(&ck, &rck, rules)?;
        rep.findings.extend(f);
        sort(&mut rep.findings);
        rep.reference = Some(rdir.to_path_buf());
        rep.bytes_read = ck.bytes_read() + rck.bytes_read();
    }
    rep.seconds = t0.elapsed().as_secs_f64();
    Ok(rep)
}

fn sort(v: &mut [Finding]) {
    use crate::checkpoint::naming::natural_key;
    v.sort_by(|a, b| {
        b.severity
            .cmp(&a.severity)
            .then_with(|| natural_key(&a.tensor).cmp(&natural_key(&b.tensor)))
            .then_with(|| a.rule.cmp(&b.rule))
    });
}

pub use output::{to_json, to_markdown, to_text};
