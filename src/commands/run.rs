//! `run`: every op of the requested layers on the three numerics paths; table, markdown, JSON, dumps, plots.

use std::path::{Path, PathBuf};

use crate::backend::Backend;
use crate::checkpoint::Checkpoint;
use crate::checkpoint::GuardCheckpoint;
use crate::cli::{BackendChoice, RunArgs, TokenArgs};
use crate::error::{EXIT_FINDINGS, EXIT_OK};
use crate::model::layers::LayerRange;
use crate::output::{Guard, Outputs};
use crate::probe::spec::ProbeSpec;
use crate::probe::{self, RunOptions, RunResult};
use crate::report::{self, RunMeta};
use crate::served::faults::Fault;
use crate::served::Profile;
use crate::{Error, Result};

/// The checkpoint a command works on: `--model DIR` or the built-in tiny synthetic model.
pub fn open_model(model: Option<&Path>, seed: u64) -> Result<Checkpoint> {
    match model {
        Some(dir) => Checkpoint::open(dir),
        None => crate::synth::builtin(seed),
    }
}

/// Tokens from the token options, else the probe spec, else a synthetic sequence. `fits` is
/// asked with the token count and what asked for it before a synthetic sequence is made (so a
/// `--seq-len` beyond the memory budget allocates nothing) and after any other source is read.
pub fn resolve_tokens(
    t: &TokenArgs,
    spec: &ProbeSpec,
    ckpt: &Checkpoint,
    vocab: usize,
    seed: u64,
    fits: &dyn Fn(u64, &str) -> Result<()>,
) -> Result<(Vec<u32>, String)> {
    let counted = |ids: Vec<u32>, what: String, source: String| -> Result<(Vec<u32>, String)> {
        fits(ids.len() as u64, &format!("{what} ({} tokens)", ids.len()))?;
        Ok((ids, source))
    };
    if let Some(ids) = &t.token_ids {
        outside_vocab(ids, vocab).map_err(|m| Error::usage(format!("--token-ids: {m}")))?;
        return counted(ids.clone(), "--token-ids".into(), "--token-ids".into());
    }
    if let Some(f) = &t.tokens {
        let text = crate::input::read_text(f, "token file", crate::input::SMALL_FILE_MAX)?;
        let ids: Vec<u32> = serde_json::from_str(&text)
            .map_err(|e| Error::bad(f, None, format!("expected a JSON array of token ids: {e}")))?;
        outside_vocab(&ids, vocab).map_err(|m| Error::bad(f, None, m))?;
        let name = format!("--tokens {}", f.display());
        return counted(ids, name, format!("file {}", f.display()));
    }
    if let Some(p) = t.prompt.as_ref().or(spec.tokens.prompt.as_ref()) {
        let ids = crate::tokenize::encode(ckpt, p)?;
        return counted(ids, "--prompt".into(), "prompt".into());
    }
    if let Some(ids) = &spec.tokens.ids {
        outside_vocab(ids, vocab)
            .map_err(|m| Error::usage(format!("probe spec `{}`: tokens.ids: {m}", spec.name)))?;
        let name = "the probe spec's token ids".to_string();
        return counted(ids.clone(), name, format!("probe {}", spec.name));
    }
    let n = t.seq_len.or(spec.tokens.seq_len).unwrap_or(64);
    fits(n as u64, &format!("--seq-len {n}"))?;
    Ok((
        probe::synthetic_tokens(n, vocab, seed),
        format!("synthetic (seed {seed})"),
    ))
}

/// The first id at or past `vocab`, said with its position (the runner checks every source
/// again; here the message can name where the id came from).
fn outside_vocab(ids: &[u32], vocab: usize) -> std::result::Result<(), String> {
    match ids.iter().position(|&t| t as usize >= vocab) {
        Some(i) => Err(format!(
            "token id {} (position {i}) is outside the model's vocabulary (vocab_size {vocab})",
            ids[i]
        )),
        None => Ok(()),
    }
}

/// Pick the backend; `auto` falls back to the CPU with one line saying why, an explicit
/// `--backend cuda` without a usable device is an error (exit 2) with the reason.
pub fn select_backend(choice: BackendChoice) -> Result<(Backend, String, String)> {
    match choice {
        BackendChoice::Cpu => Ok((Backend::Cpu, "cpu".into(), cpu_device())),
        BackendChoice::Cuda => match crate::backend::open_cuda() {
            Ok(g) => {
                let d = g.lock().map(|g| g.describe()).unwrap_or_default();
                Ok((Backend::Cuda(g), "cuda".into(), d))
            }
            Err(why) => Err(Error::Backend(format!("--backend cuda: {why}"))),
        },
        BackendChoice::Auto => match crate::backend::open_cuda() {
            Ok(g) => {
                let d = g.lock().map(|g| g.describe()).unwrap_or_default();
                eprintln!("backend: cuda on {d}");
                Ok((Backend::Cuda(g), "cuda".into(), d))
            }
            Err(why) => {
                eprintln!("backend: cpu ({why})");
                Ok((Backend::Cpu, "cpu".into(), cpu_device()))
            }
        },
    }
}

fn cpu_device() -> String {
    format!(
        "cpu ({} threads)",
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    )
}

/// Everything `run` and `bisect` share: open, resolve options, run.
pub struct Prepared {
    pub ckpt: Checkpoint,
    pub opts: RunOptions,
    pub meta: RunMeta,
    pub model_dir: Option<PathBuf>,
}

#[allow(clippy::too_many_arguments)]
pub fn prepare(
    model: Option<&Path>,
    layers: Option<LayerRange>,
    tokens: &TokenArgs,
    probe_file: Option<&Path>,
    served: Option<&str>,
    backend: BackendChoice,
    loader_faults: &[String],
    seed: u64,
    mem: &crate::cli::MemArgs,
    engine: &crate::cli::EngineArgs,
) -> Result<Prepared> {
    let max_mem = mem.max_mem;
    let choice = backend;
    let spec = match probe_file {
        Some(p) => ProbeSpec::from_file(p)?,
        None => ProbeSpec::builtin(),
    };
    // The device's start (driver, context, kernels) and the checkpoint's headers overlap: one
    // waits on the driver, the other on the disk. A backend error still comes first.
    let (sel, ckpt) = std::thread::scope(|s| {
        let h = s.spawn(|| open_model(model, seed));
        let sel = select_backend(backend);
        crate::profile::mark("backend ready");
        let ckpt = h.join().unwrap_or_else(|_| {
            Err(Error::Backend(
                "internal: opening the checkpoint panicked".into(),
            ))
        });
        (sel, ckpt)
    });
    let (mut backend_sel, mut backend, mut device) = sel?;
    let ckpt = ckpt?;
    crate::profile::mark("checkpoint opened");
    let cfg = ckpt.model_config()?.clone();
    // a quantization config the tensors cannot be checked against (lint: `config.scheme`)
    ckpt.check_quant_declared()?;
    // a model family whose ops have no CUDA version yet: `auto` runs it on the CPU, `cuda` refuses
    if let (Some(why), true) = (
        crate::model::family::cuda_unsupported(&cfg),
        backend_sel.on_device(),
    ) {
        if choice == BackendChoice::Cuda {
            return Err(Error::usage(format!("--backend cuda: {why}")));
        }
        eprintln!("backend: cpu ({why})");
        (backend_sel, backend, device) = select_backend(BackendChoice::Cpu)?;
    }
    // the built-in spec's `0..4` means the first five layers, or all of a smaller model
    let spec_layers = probe_file.and(spec.layers);
    let (a, b) = layers
        .or(spec_layers)
        .unwrap_or(LayerRange::default_for(cfg.num_hidden_layers))
        .check(cfg.num_hidden_layers)?;
    if backend_sel.on_device() {
        // the disk starts on the first layer's weights while the rest of the command sets up
        let n = crate::backend::readahead::start_early_read(
            &ckpt,
            b,
            crate::backend::readahead::EARLY_READ_BYTES,
        );
        crate::profile::mark(&format!("early read of {:.1} MB started", n as f64 / 1e6));
    }
    // every shape the config fixes, for the layers run (lint: `config.model`), before any op runs
    // (headers and scalar scales: the metas lint reads again after the run, cached)
    let with_head = b + 1 == cfg.num_hidden_layers && ckpt.resolve("head.weight").is_some();
    crate::checkpoint::shapes::check_shapes(&ckpt, &cfg, b, with_head)?;
    let profile = Profile::parse(
        served
            .or(spec.served.as_deref())
            .unwrap_or("blackwell-w4a4"),
    )?;
    let faults = loader_faults
        .iter()
        .map(|s| Fault::parse(s))
        .collect::<Result<Vec<_>>>()?;
    crate::served::faults::check_loader_faults(&ckpt, &faults)?;
    crate::served::faults::check_fault_layers(&faults, (a, b))?;
    let prefill = prefill_of(engine, &cfg, (a, b))?;
    crate::profile::mark("options checked");
    // the run's memory estimate is checked as soon as the token count is known, before the
    // tokens (or anything else of the run's size) are made; a long CPU run is announced
    let on_device = backend_sel.on_device();
    let fits = |n: u64, what: &str| -> Result<()> {
        let plan = crate::probe::budget::Plan {
            layers: (a, b),
            tokens: n,
            keep_outputs: false,
            kept_rows: None,
            with_head,
            layer_states: false,
            device: on_device,
            chunk: None,
        };
        // in token chunks when asked, or when the whole prompt would not fit (as the runner)
        let chunk = crate::probe::budget::token_chunk(
            &cfg,
            &plan,
            mem.chunk,
            mem.mem_gib,
            max_mem,
            &backend_sel,
        )?;
        let plan = crate::probe::budget::Plan { chunk, ..plan };
        let est = crate::probe::budget::check(&cfg, &plan, max_mem, &backend_sel, what)?;
        if crate::profile::enabled() {
            eprintln!(
                "profile: {what}: estimated host {} ({:?}), CPU {:.1} s",
                crate::probe::budget::gib(est.host()),
                est,
                est.cpu_seconds
            );
        }
        if !on_device && est.cpu_seconds > 60.0 {
            eprintln!(
                "warning: {what} on the CPU backend is estimated at {:.0} s ({} tokens, layers {a}..{b}); --backend cuda, fewer tokens or fewer layers are faster",
                est.cpu_seconds, n
            );
        }
        Ok(())
    };
    let (toks, source) = resolve_tokens(tokens, &spec, &ckpt, cfg.vocab_size, seed, &fits)?;
    crate::profile::mark("tokens resolved");
    let meta = RunMeta {
        tool: "nvfp4-probe".into(),
        version: env!("CARGO_PKG_VERSION").into(),
        backend,
        device,
        checkpoint: report::checkpoint_fingerprint(&ckpt),
        tokens: report::token_fingerprint(&toks, &source),
        probe: spec.clone(),
        served_profile: profile.name().into(),
        loader_faults: loader_faults.to_vec(),
        served_chunk: prefill.as_ref().map(|p| p.chunk),
        engine_faults: prefill
            .as_ref()
            .map(|p| p.faults.iter().map(|f| f.spec()).collect())
            .unwrap_or_default(),
        layers: [a, b],
        seconds: 0.0,
        bytes_read: 0,
    };
    let opts = RunOptions {
        profile,
        loader_faults: faults,
        spec,
        progress: true,
        backend: backend_sel,
        max_mem,
        chunk: mem.chunk,
        mem_gib: mem.mem_gib,
        prefill,
        ..RunOptions::new((a, b), toks)
    };
    Ok(Prepared {
        ckpt,
        opts,
        meta,
        model_dir: model.map(Path::to_path_buf),
    })
}

/// `--served-chunk` / `--engine-fault` as the runner takes them; a model family other than
/// DeepSeek-V4 has no chunked-prefill state here and is refused (exit 2).
fn prefill_of(
    engine: &crate::cli::EngineArgs,
    cfg: &crate::model::ModelConfig,
    layers: (usize, usize),
) -> Result<Option<crate::served::engine::Prefill>> {
    use crate::served::engine::{EngineFault, Prefill};
    let Some(n) = engine.served_chunk else {
        return Ok(None);
    };
    if let Some(f) = &cfg.family {
        return Err(Error::usage(format!(
            "--served-chunk: the engine's chunked prefill is emulated for DeepSeek-V4 layers only, not {}",
            f.kind.label()
        )));
    }
    let faults = engine
        .engine_faults
        .iter()
        .map(|s| EngineFault::parse(s))
        .collect::<Result<Vec<_>>>()?;
    for f in &faults {
        if f.layer.is_some_and(|l| l >= cfg.num_hidden_layers) {
            return Err(Error::usage(format!(
                "engine fault `{}`: the model has {} layers (L0..L{})",
                f.spec(),
                cfg.num_hidden_layers,
                cfg.num_hidden_layers.saturating_sub(1)
            )));
        }
    }
    crate::served::engine::check_fault_layers(&faults, layers)?;
    Prefill::new(n, faults).map(Some)
}

/// The outputs' guard of a command on an optional model directory: the directory, its shards'
/// real directories (from the opened checkpoint too when given) and the command's input files.
pub fn guard(
    model: Option<&Path>,
    ckpt: Option<&Checkpoint>,
    inputs: &[&Option<PathBuf>],
) -> Guard {
    let mut g = Guard::new();
    if let Some(m) = model {
        g = g.model_dir(m);
        if let Some(c) = ckpt {
            g = g.checkpoint(c);
        }
    }
    for i in inputs.iter().copied().flatten() {
        g = g.input(i, "the input");
    }
    g
}

/// `--reference DIR` in the outputs' guard: the directory, and its shards once it is open (an
/// output never goes inside the original, which is only read).
pub fn guard_reference(g: Guard, dir: Option<&Path>, rck: Option<&Checkpoint>) -> Guard {
    let Some(d) = dir else { return g };
    let g = g.model_dir(d);
    match rck {
        Some(c) => g.checkpoint(c),
        None => g,
    }
}

/// `--reference DIR`: the original opened (exit 2 when it is unusable) and compared, before
/// anything runs, with the weights a run of layers 0..=`last` reads.
pub fn reference_check(
    ckpt: &Checkpoint,
    dir: Option<&Path>,
    last: usize,
) -> Result<(Option<Checkpoint>, Vec<crate::lint::reference::RefFinding>)> {
    let Some(d) = dir else {
        return Ok((None, Vec::new()));
    };
    let rck = Checkpoint::open(d)?;
    let refs =
        crate::lint::reference::compare_layers(ckpt, &rck, &crate::lint::Rules::default(), last)?;
    crate::profile::mark("reference compared");
    Ok((Some(rck), refs))
}

/// The reference findings among a command's findings (`divergent`: the ops that diverged, which
/// make a reference finding of theirs harmful); the caller orders them.
pub fn add_reference_findings(
    found: &mut Vec<probe::findings::Finding>,
    refs: &[crate::lint::reference::RefFinding],
    divergent: &std::collections::HashSet<&str>,
    strict: bool,
) {
    found.extend(probe::findings::reference_findings(refs, divergent, strict));
}

/// Check `run`'s outputs against `outs`' guard.
fn check_outputs(args: &RunArgs, outs: &Outputs) -> Result<()> {
    for out in [&args.json, &args.markdown].into_iter().flatten() {
        outs.check(out)?;
    }
    if let Some(pl) = &args.plot {
        for f in crate::plot::plot_files(pl)? {
            outs.check(&f)?;
        }
    }
    if let Some(d) = &args.dump {
        outs.check_dir(d)?;
    }
    Ok(())
}

pub fn main(args: &RunArgs) -> Result<i32> {
    let inputs = [&args.probe, &args.tokens.tokens];
    // refused before anything is opened, and again with the checkpoint's shards known
    let early = guard(args.model.as_deref(), None, &inputs);
    check_outputs(
        args,
        &Outputs::new(guard_reference(early, args.reference.as_deref(), None)),
    )?;
    let mut p = prepare(
        args.model.as_deref(),
        args.layers,
        &args.tokens,
        args.probe.as_deref(),
        args.served.as_deref(),
        args.backend,
        &args.loader_faults,
        args.seed,
        &args.mem,
        &args.engine,
    )?;
    p.opts.experts = if args.no_expert_metrics {
        probe::experts::ExpertMetrics::Off
    } else if args.exercise_experts {
        probe::experts::ExpertMetrics::Exercise
    } else {
        probe::experts::ExpertMetrics::Routed
    };
    let (rck, refs) = reference_check(&p.ckpt, args.reference.as_deref(), p.opts.layers.1)?;
    let g = guard(p.model_dir.as_deref(), Some(&p.ckpt), &inputs);
    let mut outs = Outputs::new(guard_reference(g, args.reference.as_deref(), rck.as_ref()));
    check_outputs(args, &outs)?;
    drop(rck);
    p.opts.keep_outputs = args.dump.is_some();
    if let Some(r) = &args.dump_rows {
        p.opts.keep_rows = Some(r.resolve(p.opts.tokens.len())?);
    }
    crate::profile::mark("prepared");
    // the static lint of what the run reads (a broken scale the oracle shares never diverges),
    // on its own thread beside the runner: it reads headers and scales only
    let read0 = p.ckpt.bytes_read();
    let (res, lint) = std::thread::scope(|s| {
        let lint = s.spawn(|| {
            crate::lint::lint_layers(&p.ckpt, &crate::lint::Rules::default(), p.opts.layers.1)
        });
        let res = probe::run(&p.ckpt, &p.opts);
        let lint = lint.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
        (res, lint)
    });
    let mut res: RunResult = res?;
    crate::profile::mark("runner done");
    let lint = lint?;
    // what the command read, the lint's headers and scales included (both have finished)
    res.bytes_read = p.ckpt.bytes_read() - read0;
    let mut found = probe::findings::run_findings(&res, &lint.findings, args.strict);
    if !refs.is_empty() {
        let divergent = res
            .records
            .iter()
            .filter(|r| r.divergent)
            .map(|r| r.id.as_str())
            .collect();
        add_reference_findings(&mut found, &refs, &divergent, args.strict);
        let steps: std::collections::HashMap<&str, usize> = res
            .records
            .iter()
            .map(|r| (r.id.as_str(), r.step))
            .collect();
        probe::findings::sort(&mut found, |op| {
            steps.get(op).copied().unwrap_or(usize::MAX)
        });
    }
    let exit = probe::findings::exit_code(&found);
    res.summary.findings = Some(found);
    p.meta.seconds = res.seconds;
    p.meta.bytes_read = res.bytes_read;
    // every line within the terminal's width (120 columns when stdout is not a terminal)
    let width = crate::output::term::width();
    let mut text = String::new();
    if !args.quiet {
        text.push_str(&report::terminal_table(&res, width));
        text.push('\n');
        text.push_str(&report::legend(&p.opts.spec.thresholds));
        text.push('\n');
    }
    for l in report::summary_lines(&res) {
        text.push_str(&l);
        text.push('\n');
    }
    text.push_str(&probe::findings::terminal(
        res.summary.findings.as_deref().unwrap_or(&[]),
    ));
    text.push_str(&format!(
        "{} ops, {:.2} s, {:.1} MB read from the checkpoint\n",
        res.records.len(),
        res.seconds,
        res.bytes_read as f64 / 1e6
    ));
    print!("{}", crate::output::term::fit(&text, width));
    // outputs are written only after the run succeeded, all or none
    let json =
        (args.json.is_some() || args.plot.is_some()).then(|| report::run_json(&p.meta, &res));
    if let (Some(j), Some(text)) = (&args.json, &json) {
        outs.file(j, text.as_bytes())?;
    }
    if let Some(md) = &args.markdown {
        outs.file(md, report::markdown(&p.meta, &res).as_bytes())?;
    }
    if let Some(d) = &args.dump {
        report::dump(&mut outs, d, &res, &p.opts.tokens)?;
    }
    if let (Some(pl), Some(text)) = (&args.plot, &json) {
        let run = crate::run_json::parse_run(text, "run JSON")?;
        crate::plot::plot_into(&run, pl, &mut outs)?;
    }
    outs.publish_and_report()?;
    crate::profile::mark("reports written");
    let findings = exit != EXIT_OK || res.summary.non_finite_ops > 0;
    drop(res);
    drop(p);
    crate::profile::mark("released");
    Ok(if findings { EXIT_FINDINGS } else { EXIT_OK })
}
