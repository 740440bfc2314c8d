//! `selftest`: the CUDA kernels against the CPU reference, then whole runs on both backends.

use std::time::Instant;

use comfy_table::Table;

use crate::backend::Backend;
use crate::cli::{BackendChoice, SelftestArgs, SelftestBackend, TokenArgs};
use crate::commands::run::prepare;
use crate::output::Outputs;
use crate::selftest::{compare_runs, differing_ops, kernels, Check};
use crate::{probe, Error, Result};

pub fn main(args: &SelftestArgs) -> Result<i32> {
    let mut outs = Outputs::new(super::run::guard(args.model.as_deref(), None, &[]));
    for out in [&args.json, &args.rcp_table].into_iter().flatten() {
        outs.check(out)?;
    }
    if args.backend == SelftestBackend::Cpu {
        return Err(Error::usage(
            "selftest compares the CUDA backend with the CPU reference: run it with --backend cuda (or auto) on a machine with a GPU",
        ));
    }
    let gpu =
        crate::backend::open_cuda().map_err(|why| Error::Backend(format!("selftest: {why}")))?;
    let desc = gpu.lock().map(|g| g.describe()).unwrap_or_default();
    println!("device: {desc}");
    let t0 = Instant::now();
    let checks: Vec<Check> = {
        let mut g = gpu
            .lock()
            .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?;
        kernels(&mut g, args.scale, args.seed)?
    };
    let mut table = Table::new();
    table.load_style(comfy_table::presets::ASCII_MARKDOWN);
    table.set_header(vec![
        "kernel check",
        "cases",
        "mismatches",
        "worst",
        "tol",
        "result",
        "note",
    ]);
    for c in &checks {
        table.add_row(vec![
            c.name.clone(),
            c.cases.to_string(),
            c.mismatches.to_string(),
            if c.tolerance > 0.0 {
                format!("{:.2e}", c.worst)
            } else {
                "-".into()
            },
            if c.tolerance > 0.0 {
                format!("{:.0e}", c.tolerance)
            } else {
                "exact".into()
            },
            if c.pass() {
                "PASS".into()
            } else {
                "FAIL".into()
            },
            c.note.clone(),
        ]);
    }
    println!("{table}");
    let kfail = checks.iter().filter(|c| !c.pass()).count();
    println!(
        "kernels: {}/{} checks pass ({:.1} s)",
        checks.len() - kfail,
        checks.len(),
        t0.elapsed().as_secs_f64()
    );
    if let Some(f) = &args.rcp_table {
        let mut g = gpu
            .lock()
            .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?;
        let t = crate::selftest::rcp_table(&mut g)?;
        let bytes: Vec<u8> = t.iter().map(|&v| v as u8).collect();
        outs.file(f, &bytes)?;
        let hist = [-2i8, -1, 0, 1, 2].map(|d| t.iter().filter(|&&v| v == d).count());
        println!("rcp table: ulp deviation -2..2 counts {hist:?}");
    }
    let mut benches = Vec::new();
    if let Some(gib) = args.bench {
        let mut g = gpu
            .lock()
            .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?;
        benches = crate::selftest::bench(&mut g, gib)?;
        let mut t = Table::new();
        t.load_style(comfy_table::presets::ASCII_MARKDOWN);
        t.set_header(vec![
            "kernel",
            "bytes moved",
            "median ms",
            "GB/s",
            "vs D2D copy",
        ]);
        for b in &benches {
            t.add_row(vec![
                b.what.clone(),
                format!("{:.2} GB", b.bytes as f64 / 1e9),
                format!("{:.3}", b.median_ms),
                format!("{:.0}", b.gb_per_s),
                format!("{:.0} %", b.vs_d2d * 100.0),
            ]);
        }
        println!("{t}");
    }
    let mut runs = Vec::new();
    let mut rfail = 0;
    if !args.kernels_only {
        let tokens = TokenArgs {
            seq_len: Some(args.seq_len),
            ..Default::default()
        };
        for profile in &args.served {
            let mut p = prepare(
                args.model.as_deref(),
                Some(args.layers),
                &tokens,
                None,
                Some(profile),
                BackendChoice::Cpu,
                &[],
                args.seed,
                &Default::default(),
                &Default::default(),
            )?;
            p.opts.progress = false;
            let cpu = probe::run(&p.ckpt, &p.opts)?;
            p.opts.backend = Backend::Cuda(gpu.clone());
            let gpu_res = probe::run(&p.ckpt, &p.opts)?;
            let a = compare_runs(&cpu, &gpu_res);
            // the routed experts deferred and run chunk by chunk (one expert per chunk), and not
            // deferred at all: every field of every op's record the same as the default's
            let set_chunk = |c: usize| -> Result<usize> {
                let mut g = gpu
                    .lock()
                    .map_err(|_| Error::Backend("cuda: device state poisoned".into()))?;
                Ok(std::mem::replace(&mut g.expert_chunk, c))
            };
            let mut chunk_diff = Vec::new();
            for c in [1usize, 0] {
                let chunk = set_chunk(c)?;
                let r = probe::run(&p.ckpt, &p.opts);
                set_chunk(chunk)?;
                let differ = differing_ops(&gpu_res.records, &r?.records);
                if !differ.is_empty() {
                    chunk_diff.push(format!(
                        "experts chunk {c}: {} fields differ from chunk {chunk}, first {}",
                        differ.len(),
                        differ[0]
                    ));
                }
            }
            // the attention over chunks of 7 query tokens (boundaries off the compression
            // ratios' multiples): the same records as in one call
            p.opts.chunk = Some(7);
            let r = probe::run(&p.ckpt, &p.opts);
            p.opts.chunk = None;
            let differ = differing_ops(&gpu_res.records, &r?.records);
            if !differ.is_empty() {
                chunk_diff.push(format!(
                    "attention chunks of 7: {} fields differ from one call, first {}",
                    differ.len(),
                    differ[0]
                ));
            }
            let ok = a.stat_mismatches.is_empty()
                && a.worst_cos_delta <= 1e-4
                && a.divergent_cpu == a.divergent_gpu
                && chunk_diff.is_empty();
            if !ok {
                rfail += 1;
            }
            println!(
                "whole run `{profile}` layers {} T={}: {} ops; amax/NaN/Inf mismatches {}; worst |Δcos| {:.2e} at {}; worst amax rel {:.2e}; divergent ops cpu {} / cuda {}; experts by chunks of 1 and undeferred, attention by chunks of 7, vs default: {}; cpu {:.2} s, cuda {:.2} s — {}",
                args.layers,
                args.seq_len,
                a.ops,
                a.stat_mismatches.len(),
                a.worst_cos_delta,
                if a.worst_cos_op.is_empty() { "-" } else { &a.worst_cos_op },
                a.worst_amax_rel,
                a.divergent_cpu,
                a.divergent_gpu,
                if chunk_diff.is_empty() { "identical" } else { "DIFFER" },
                cpu.seconds,
                gpu_res.seconds,
                if ok { "PASS" } else { "FAIL" }
            );
            for m in a.stat_mismatches.iter().take(10) {
                println!("  {m}");
            }
            for m in &chunk_diff {
                println!("  {m}");
            }
            runs.push(serde_json::json!({
                "profile": profile,
                "agreement": a,
                "cpu_seconds": cpu.seconds,
                "cuda_seconds": gpu_res.seconds,
                "experts_chunking": if chunk_diff.is_empty() { serde_json::json!("identical") } else { serde_json::json!(chunk_diff) },
                "pass": ok,
            }));
        }
        // each model family's tiny model, CPU against CUDA (with the built-in models only)
        if args.model.is_none() {
            for r in crate::selftest::family::runs(
                Backend::Cuda(gpu.clone()),
                &args.served,
                args.seq_len,
                args.seed,
            )? {
                println!("{}", r.line);
                for m in &r.details {
                    println!("  {m}");
                }
                rfail += usize::from(!r.pass);
                runs.push(r.json);
            }
        }
    }
    if let Some(j) = &args.json {
        let v = serde_json::json!({
            "schema": "nvfp4-probe.selftest/1",
            "device": desc,
            "kernels": checks.iter().map(|c| serde_json::json!({
                "name": c.name, "cases": c.cases, "mismatches": c.mismatches,
                "worst": c.worst, "tolerance": c.tolerance, "pass": c.pass(), "note": c.note,
            })).collect::<Vec<_>>(),
            "runs": runs,
            "bench": benches,
        });
        outs.file(
            j,
            serde_json::to_string_pretty(&v)
                .unwrap_or_default()
                .as_bytes(),
        )?;
    }
    outs.publish_and_report()?;
    let fails = kfail + rfail;
    println!(
        "selftest: {}",
        if fails == 0 {
            "all checks pass".to_string()
        } else {
            format!("{fails} check(s) FAIL")
        }
    );
    Ok(if fails == 0 { 0 } else { 1 })
}
