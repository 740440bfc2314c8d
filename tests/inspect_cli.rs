//! `nvfp4-probe inspect`: table, `--json`, `--dequant`, exit codes, and the header-only
//! promise on a full-size 256-expert layer.

#[path = "checkpoint_common/mod.rs"]
mod common;

use assert_cmd::Command;
use common::*;
use nvfp4_probe::checkpoint::{Checkpoint, Dtype};
use std::io::Write;
use std::path::Path;

fn cli() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

/// The official tiny layer with block scales replaced by byte patterns whose fractions are
/// known: wo_b (ModelOpt, 128 bytes): 32 × 0x00, 16 × 0x7E, 8 × 0x7F, rest 0x38;
/// experts.0.w1 (MXFP4, 64 bytes): 8 × 0xFF, 16 × 0x00, rest 0x7F.
fn patterned_model(dir: &Path) -> Vec<(String, Built)> {
    let mut weights = official_layer([128, 128]);
    for (base, b) in weights.iter_mut() {
        if base == "layers.0.attn.wo_b" {
            let s = &mut b.parts[1].3;
            for (k, x) in s.iter_mut().enumerate() {
                *x = match k {
                    0..32 => 0x00,
                    32..48 => 0x7E,
                    48..56 => 0x7F,
                    _ => 0x38,
                };
            }
        }
        if base == "layers.0.ffn.experts.0.w1" {
            let s = &mut b.parts[1].3;
            for (k, x) in s.iter_mut().enumerate() {
                *x = match k {
                    0..8 => 0xFF,
                    8..24 => 0x00,
                    _ => 0x7F,
                };
            }
        }
    }
    write(
        dir,
        &tensors(&weights, |b, s| format!("{b}.{s}")),
        CONFIG,
        usize::MAX,
    );
    weights
}

#[test]
fn table_lists_every_weight() {
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    let out = cli()
        .args(["inspect", "--all", "--model"])
        .arg(d.path())
        .assert()
        .success();
    let s = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    for name in ["layers.0.attn.wq_a", "layers.0.ffn.experts.1.w2", "head"] {
        assert!(s.contains(name), "{name} missing:\n{s}");
    }
    for scheme in ["bf16", "fp8-block", "mxfp4", "nvfp4-ct", "nvfp4-modelopt"] {
        assert!(s.contains(scheme), "{scheme} missing:\n{s}");
    }
    assert!(s.contains("10 weights"), "{s}");
    // 25 % zero, 12.5 % saturated, 6.25 % NaN block scales on wo_b (the cell's two lines)
    let lines: Vec<&str> = s.lines().collect();
    let i = lines
        .iter()
        .position(|l| l.contains("layers.0.attn.wo_b"))
        .expect("wo_b's row");
    assert!(
        lines[i].contains("0x00 25.00% · 0x7E 12.50%") && lines[i + 1].contains("· NaN 6.25%"),
        "{s}"
    );
    for l in &lines {
        assert!(l.chars().count() <= 120, "wider than 120 columns: {l}");
    }
}

#[test]
fn json_report() {
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    let o = tempfile::tempdir().unwrap();
    let j = o.path().join("inspect.json");
    cli()
        .args(["inspect", "--model"])
        .arg(d.path())
        .arg("--json")
        .arg(&j)
        .assert()
        .success();
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    assert_eq!(v["schema"], "nvfp4-probe.inspect/1");
    let ws = v["weights"].as_array().unwrap();
    assert_eq!(ws.len(), 10);
    let row = |n: &str| ws.iter().find(|w| w["canonical"] == n).unwrap().clone();
    let f = |x: &serde_json::Value| x.as_f64().unwrap() as f32;

    let ct = row("layers.0.attn.wo_a");
    assert_eq!(ct["scheme"], "nvfp4-ct");
    assert_eq!(ct["convention"], "ct");
    assert_eq!(ct["raw"], "layers.0.attn.wo_a.weight_packed");
    assert_eq!(ct["shape"], serde_json::json!([32, 64]));
    let g = 30_927.102_f32;
    assert_eq!(f(&ct["weight_global_scale"]), g);
    assert_eq!(f(&ct["weight_amax_implied"]), 2688.0 / g);
    assert_eq!(f(&ct["input_global_scale"]), 448.0);
    assert_eq!(f(&ct["input_amax_implied"]), 6.0);

    let mo = row("layers.0.attn.wo_b");
    assert_eq!(mo["convention"], "modelopt");
    let dd = 3.233_41e-5_f32;
    assert_eq!(f(&mo["weight_amax_implied"]), 2688.0 * dd);
    assert_eq!(f(&mo["input_amax_implied"]), 2688.0 * 0.25);
    let bs = &mo["block_scale"];
    assert_eq!(bs["count"], 128);
    assert_eq!(bs["frac_zero"], 0.25);
    assert_eq!(bs["frac_7e"], 0.125);
    assert_eq!(bs["frac_nan"], 0.0625);
    assert_eq!(f(&bs["max_scale"]), 448.0);
    // Largest decodable value: E2M1 max 6 × largest finite scale 448 × d.
    assert_eq!(f(&mo["weight_amax_from_scales"]), 6.0 * (448.0 * dd));

    let mx = row("layers.0.ffn.experts.0.w1");
    assert_eq!(mx["scheme"], "mxfp4");
    assert!(mx["convention"].is_null());
    assert_eq!(mx["block_scale"]["kind"], "Ue8m0");
    assert_eq!(mx["block_scale"]["frac_ff"], 0.125);
    assert_eq!(mx["block_scale"]["frac_zero"], 0.25);
    assert_eq!(f(&mx["weight_amax_from_scales"]), 6.0); // 2^(127-127) × 6

    let fp8 = row("layers.0.attn.wq_b");
    assert_eq!(fp8["scheme"], "fp8-block");
    assert!(fp8["weight_global_scale"].is_null());

    let no_input = row("layers.0.ffn.experts.1.w1");
    assert!(no_input["input_global_scale"].is_null());
    assert!(row("head")["block_scale"].is_null());
}

fn read_f32(path: &Path) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let buf = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    st.tensors()
        .into_iter()
        .map(|(n, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32);
            let d = v
                .data()
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect();
            (n, v.shape().to_vec(), d)
        })
        .collect()
}

#[test]
fn dequant_writes_one_f32_tensor() {
    let d = tempfile::tempdir().unwrap();
    let weights = patterned_model(d.path());
    let o = tempfile::tempdir().unwrap();
    for (arg, base) in [
        ("layers.0.attn.wo_a", "layers.0.attn.wo_a"),
        (
            "layers.0.ffn.experts.1.w2.weight",
            "layers.0.ffn.experts.1.w2",
        ),
        ("layers.0.attn.wq_b", "layers.0.attn.wq_b"),
    ] {
        let out = o.path().join(format!("{base}.safetensors"));
        cli()
            .args(["inspect", "--model"])
            .arg(d.path())
            .args(["--dequant", arg, "--out"])
            .arg(&out)
            .assert()
            .success();
        let t = read_f32(&out);
        assert_eq!(t.len(), 1);
        let b = &weights.iter().find(|w| w.0 == base).unwrap().1;
        assert_eq!(t[0].0, format!("{base}.weight"));
        assert_eq!(t[0].1, vec![b.out, b.inp]);
        // wo_b's patterned scales make NaNs; these three keep their spec-computed values.
        assert_f32_eq(&t[0].2, &b.expected, base);
    }
}

#[test]
fn dequant_by_hf_raw_name_uses_canonical_name() {
    let d = tempfile::tempdir().unwrap();
    let b = nvfp4(32, 64, true, false, 4);
    let t: Vec<_> = b
        .parts
        .iter()
        .map(|(s, dt, sh, by)| {
            (
                format!("model.layers.0.self_attn.o_a_proj.{s}"),
                *dt,
                sh.clone(),
                by.clone(),
            )
        })
        .collect();
    write(d.path(), &t, CONFIG, usize::MAX);
    let o = tempfile::tempdir().unwrap();
    let out = o.path().join("x.safetensors");
    cli()
        .args(["inspect", "--model"])
        .arg(d.path())
        .args([
            "--dequant",
            "model.layers.0.self_attn.o_a_proj.weight_packed",
            "--out",
        ])
        .arg(&out)
        .assert()
        .success();
    let t = read_f32(&out);
    assert_eq!(t[0].0, "layers.0.attn.wo_a.weight");
    assert_f32_eq(&t[0].2, &b.expected, "wo_a");
}

#[test]
fn dequant_refuses_model_directory() {
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    let out = d.path().join("deq.safetensors");
    let a = cli()
        .args(["inspect", "--model"])
        .arg(d.path())
        .args(["--dequant", "head", "--out"])
        .arg(&out)
        .assert()
        .code(2);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("model directory"));
    assert!(!out.exists());
    // Through a path that only resolves into the model directory.
    let sub = d.path().join("sub");
    std::fs::create_dir(&sub).unwrap();
    let out = sub.join("..").join("deq2.safetensors");
    cli()
        .args(["inspect", "--model"])
        .arg(d.path())
        .args(["--dequant", "head", "--out"])
        .arg(&out)
        .assert()
        .code(2);
    assert!(!d.path().join("deq2.safetensors").exists());
}

#[test]
fn dequant_unknown_name_exits_2() {
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    let o = tempfile::tempdir().unwrap();
    let a = cli()
        .args(["inspect", "--model"])
        .arg(d.path())
        .args(["--dequant", "layers.9.attn.nothing", "--out"])
        .arg(o.path().join("x.safetensors"))
        .assert()
        .code(2);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("layers.9.attn.nothing"));
}

/// Bad inputs reach the CLI as exit 2 with the file and tensor in the message.
#[test]
fn bad_inputs_exit_2_naming_file_and_tensor() {
    let run = |dir: &Path| {
        let a = cli().args(["inspect", "--model"]).arg(dir).assert().code(2);
        String::from_utf8_lossy(&a.get_output().stderr).into_owned()
    };
    // Truncated shard.
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    let p = d.path().join("model.safetensors");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len - 3)
        .unwrap();
    let e = run(d.path());
    assert!(
        e.contains("model.safetensors") && e.contains("tensor `"),
        "{e}"
    );

    // Missing scale tensor.
    let d = tempfile::tempdir().unwrap();
    let mut t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    t.retain(|x| x.0 != "layers.0.attn.wo_b.weight_scale_2");
    write(d.path(), &t, CONFIG, usize::MAX);
    let e = run(d.path());
    assert!(
        e.contains("layers.0.attn.wo_b.weight_scale_2") && e.contains("model.safetensors"),
        "{e}"
    );

    // Shape contradicting the config.
    let d = tempfile::tempdir().unwrap();
    let mut t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    t.push((
        "layers.0.ffn.gate.weight".into(),
        Dtype::BF16,
        vec![5, 64],
        bf16_bytes(&vec![0.5; 5 * 64]),
    ));
    write(d.path(), &t, CONFIG, usize::MAX);
    let e = run(d.path());
    assert!(
        e.contains("layers.0.ffn.gate.weight") && e.contains("n_routed_experts"),
        "{e}"
    );

    // Non-JSON and missing config.
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    std::fs::write(d.path().join("config.json"), "not json").unwrap();
    assert!(run(d.path()).contains("config.json"));
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    assert!(run(d.path()).contains("config.json"));

    // Not a directory at all.
    let e = run(&d.path().join("absent"));
    assert!(e.contains("absent"), "{e}");
}

/// A V4-Flash-sized layer (hidden 4096, 256 NVFP4 experts of width 2048, FP8 attention) in a
/// sparse file: 3 GiB of packed experts that are never written (holes), ~400 MB of block scales
/// that are (so they sit in the page cache, as for a checkpoint that was just downloaded or
/// read). `inspect` must read only headers, scalars and block scales, and finish well under a
/// second.
#[test]
fn full_size_layer_reads_only_scales() {
    let cfg = r#"{"hidden_size": 4096, "num_hidden_layers": 1, "vocab_size": 129280,
        "num_attention_heads": 64, "head_dim": 512, "q_lora_rank": 1024, "o_groups": 8,
        "o_lora_rank": 1024, "compress_ratios": [4], "n_routed_experts": 256,
        "num_experts_per_tok": 6, "moe_intermediate_size": 2048}"#;
    let (dm, im, e) = (4096usize, 2048usize, 256usize);
    // (name, dtype, shape)
    let mut t: Vec<(String, &str, Vec<usize>)> = Vec::new();
    let mut scale_bytes = 0usize;
    let mut scalar_bytes = 0usize;
    for x in 0..e {
        for (p, o, i) in [("w1", im, dm), ("w3", im, dm), ("w2", dm, im)] {
            let b = format!("layers.0.ffn.experts.{x}.{p}");
            t.push((format!("{b}.weight"), "U8", vec![o, i / 2]));
            t.push((format!("{b}.weight_scale"), "F8_E4M3", vec![o, i / 16]));
            t.push((format!("{b}.weight_scale_2"), "F32", vec![]));
            t.push((format!("{b}.input_scale"), "F32", vec![]));
            scale_bytes += o * i / 16;
            scalar_bytes += 8;
        }
    }
    for (p, o, i) in [
        ("attn.wq_a", 1024, dm),
        ("attn.wkv", 512, dm),
        ("attn.wq_b", 32768, 1024),
    ] {
        t.push((format!("layers.0.{p}.weight"), "F8_E4M3", vec![o, i]));
        t.push((
            format!("layers.0.{p}.scale"),
            "F8_E8M0",
            vec![o / 128, i / 128],
        ));
        scale_bytes += (o / 128) * (i / 128);
    }
    let mut header = serde_json::Map::new();
    let mut off = 0usize;
    let mut spans = Vec::new();
    for (n, dt, s) in &t {
        let len = s.iter().product::<usize>() * if *dt == "F32" { 4 } else { 1 };
        header.insert(
            n.clone(),
            serde_json::json!({"dtype": dt, "shape": s, "data_offsets": [off, off + len]}),
        );
        spans.push((off, len, *dt, n.ends_with("scale") && *dt != "F32"));
        off += len;
    }
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), cfg).unwrap();
    let mut h = serde_json::to_vec(&header).unwrap();
    h.resize(h.len().next_multiple_of(8), b' ');
    let path = d.path().join("model.safetensors");
    let mut f = std::fs::File::create(&path).unwrap();
    f.write_all(&(h.len() as u64).to_le_bytes()).unwrap();
    f.write_all(&h).unwrap();
    f.set_len((8 + h.len() + off) as u64).unwrap(); // sparse: packed weights never written
    let base = (8 + h.len()) as u64;
    let mut scales = vec![0x38u8; 1 << 20]; // 1.0
    scales[0] = 0x7E; // one saturated block per tensor
    let d_w = 0.5f32.to_le_bytes();
    for (off, len, dt, block_scale) in spans {
        use std::io::{Seek, SeekFrom};
        let data: &[u8] = match (dt, block_scale) {
            (_, true) => &scales[..len],
            ("F32", _) => &d_w,
            _ => continue,
        };
        f.seek(SeekFrom::Start(base + off as u64)).unwrap();
        f.write_all(data).unwrap();
    }
    drop(f);

    let start = std::time::Instant::now();
    let ck = Checkpoint::open(d.path()).unwrap();
    let rows = nvfp4_probe::commands::inspect::rows(&ck).unwrap();
    let table = nvfp4_probe::commands::inspect::render_table(&rows, 1000);
    let took = start.elapsed();
    assert_eq!(rows.len(), 3 * e + 3);
    assert!(table.contains("layers.0.ffn.experts.255.w2"));
    assert_eq!(
        ck.bytes_read(),
        (scale_bytes + scalar_bytes) as u64,
        "only scales were read"
    );
    let r = rows
        .iter()
        .find(|r| r.canonical == "layers.0.ffn.experts.7.w2")
        .unwrap();
    assert_eq!(r.weight_amax_from_scales, Some(6.0 * (448.0 * 0.5)));
    assert_eq!(
        r.block_scale.as_ref().unwrap().frac_7e,
        1.0 / (4096.0 * 128.0)
    );
    // Measured 0.6 s on a shared 2-core host at load average ~8.6; the bound leaves room for a
    // loaded CI host while still catching a read of the 3 GiB of packed weights.
    assert!(took.as_secs_f64() < 2.0, "inspect took {took:?}");
    eprintln!(
        "inspect of a 256-expert layer: {took:?}, {} MB of scales",
        scale_bytes >> 20
    );
}

/// By default one line per layer (formats counted, worst block-scale health of the layer);
/// `--filter` lists the matching weights only; a filter matching nothing is a usage error.
#[test]
fn summary_by_default_and_filter() {
    let d = tempfile::tempdir().unwrap();
    patterned_model(d.path());
    let out = cli()
        .args(["inspect", "--model"])
        .arg(d.path())
        .assert()
        .success();
    let s = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    // the first line of each row (a row's cells may wrap: its later lines start blank)
    let rows: Vec<&str> = s
        .lines()
        .filter(|l| l.starts_with("│ ") && !l.starts_with("│  "))
        .collect();
    assert_eq!(rows.len(), 3, "header, L0, head:\n{s}");
    // the L0 row with its wrapped lines (the formats wrap after their commas)
    let l0: String = s
        .lines()
        .skip_while(|l| !l.starts_with("│ L0 "))
        .take_while(|l| !l.starts_with("│ head "))
        .collect();
    assert!(
        rows[1].starts_with("│ L0 ") && l0.contains("nvfp4-ct ×"),
        "{s}"
    );
    // wo_b's 25 % zero and 12.5 % saturated block scales are the layer's worst; its 6.25 % NaN
    // is not: another weight of the pattern has 12.5 % NaN scales (each column is the worst).
    assert!(
        rows[1].contains("0x00 25.00% · 0x7E 12.50% · NaN 12.50%"),
        "{s}"
    );
    assert!(rows[2].starts_with("│ head "), "{s}");
    assert!(
        !s.contains("layers.0.attn.wq_a"),
        "the summary lists no weight:\n{s}"
    );

    let out = cli()
        .args(["inspect", "--filter", "layers.0.ffn.experts.*", "--model"])
        .arg(d.path())
        .assert()
        .success();
    let s = String::from_utf8(out.get_output().stdout.clone()).unwrap();
    assert!(s.contains("layers.0.ffn.experts.1.w2"), "{s}");
    assert!(!s.contains("layers.0.attn.wq_a"), "{s}");
    let a = cli()
        .args(["inspect", "--filter", "nothing.*", "--model"])
        .arg(d.path())
        .assert()
        .code(2);
    assert!(String::from_utf8_lossy(&a.get_output().stderr).contains("--filter nothing.*"));
}
