//! The bad-input corpus of issue 18 (failure classes 5–9): one test per failure, each running the
//! real binary under a 60 s timeout and, where memory is the point, an address-space cap
//! (RLIMIT_AS), so an over-allocation aborts the child instead of passing. Every refusal must be
//! exit 2 with a message naming the file and the field or tensor; nothing may panic or hang.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use nvfp4_probe::checkpoint::Naming;
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use serde_json::{json, Value};

/// A test fails when the child runs longer than this (it is killed).
const TIMEOUT: Duration = Duration::from_secs(60);
/// Address-space cap for the child: the tiny model runs in ~60 MB resident; 2 GiB leaves room for
/// thread stacks and allocator arenas but not for any allocation a lying config asks for.
const CAP: u64 = 2 << 30;

struct Out {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    secs: f64,
}

impl Out {
    fn all(&self) -> String {
        format!("{}\n{}", self.stdout, self.stderr)
    }
}

/// Run the binary with `args` under the timeout and, when `cap` is given, RLIMIT_AS = cap.
fn probe(args: &[&str], cap: Option<u64>) -> Out {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nvfp4-probe"));
    cmd.args(args);
    cmd.env_remove("NVFP4_PROBE_PROFILE");
    #[cfg(unix)]
    if let Some(cap) = cap {
        use std::os::unix::process::CommandExt;
        // the address-space room a run may use leaves 64 MiB per worker thread for allocator
        // arenas (`probe::budget`), and a `--max-mem` is held to that room: a fixed thread count
        // keeps the room under the cap the same on any machine
        cmd.env("RAYON_NUM_THREADS", "4");
        // SAFETY: setrlimit is async-signal-safe; nothing else runs between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let lim = libc::rlimit {
                    rlim_cur: cap as libc::rlim_t,
                    rlim_max: cap as libc::rlim_t,
                };
                if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }
    let t0 = Instant::now();
    let out = assert_cmd::Command::from_std(cmd)
        .timeout(TIMEOUT)
        .output()
        .expect("spawn nvfp4-probe");
    let secs = t0.elapsed().as_secs_f64();
    let o = Out {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        secs,
    };
    assert!(
        secs < TIMEOUT.as_secs_f64() - 1.0,
        "nvfp4-probe {args:?} hung (killed after {secs:.0} s): {}",
        o.all()
    );
    o
}

/// The run was refused as unusable input: exit 2, no panic, and every `needle` in the message.
#[track_caller]
fn assert_refused(o: &Out, needles: &[&str]) {
    let all = o.all();
    assert_eq!(o.code, Some(2), "expected exit 2 ({:.1} s): {all}", o.secs);
    assert!(!all.contains("panic"), "panicked: {all}");
    for n in needles {
        assert!(o.stderr.contains(n), "message lacks `{n}`: {}", o.stderr);
    }
}

/// A tiny synthetic checkpoint (3 layers: window, HCA 128, CSA 4) in `dir/m`.
fn model(dir: &Path, format: Format) -> PathBuf {
    let m = dir.join("m");
    let mut so = SynthOptions::new(Preset::Tiny, format, Naming::Official, 0);
    so.layers = Some(3);
    synth_to_dir(&so, &m).unwrap();
    m
}

fn config(m: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(m.join("config.json")).unwrap()).unwrap()
}

fn set_config(m: &Path, f: impl FnOnce(&mut Value)) {
    let mut v = config(m);
    f(&mut v);
    std::fs::write(
        m.join("config.json"),
        serde_json::to_vec_pretty(&v).unwrap(),
    )
    .unwrap();
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// `run` of layers 0..2 over 16 tokens on the CPU, capped.
fn run_small(m: &Path, extra: &[&str]) -> Out {
    let mut a = vec![
        "run",
        "--model",
        s(m),
        "--backend",
        "cpu",
        "--layers",
        "0..2",
        "--seq-len",
        "16",
        "--quiet",
    ];
    a.extend_from_slice(extra);
    probe(&a, Some(CAP))
}

/// The shard holding `tensor` (from the index).
fn shard_of(m: &Path, tensor: &str) -> PathBuf {
    let idx: Value =
        serde_json::from_slice(&std::fs::read(m.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    m.join(idx["weight_map"][tensor].as_str().unwrap())
}

/// Split a safetensors file into (header JSON text, data bytes).
fn split(bytes: &[u8]) -> (String, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (
        String::from_utf8(bytes[8..8 + n].to_vec()).unwrap(),
        bytes[8 + n..].to_vec(),
    )
}

fn join(header: &str, data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Rewrite the shard holding `tensor` without it (offsets of the others moved down), and drop it
/// from the index too when `from_index`.
fn drop_tensor(m: &Path, tensor: &str, from_index: bool) {
    let path = shard_of(m, tensor);
    let (h, data) = split(&std::fs::read(&path).unwrap());
    let h: serde_json::Map<String, Value> = serde_json::from_str(&h).unwrap();
    let mut entries: Vec<(String, Value)> = h.into_iter().collect();
    entries.sort_by_key(|(_, v)| v["data_offsets"][0].as_u64().unwrap_or(0));
    let (mut out, mut bytes) = (serde_json::Map::new(), Vec::new());
    for (k, mut v) in entries {
        if k == "__metadata__" {
            out.insert(k, v);
            continue;
        }
        let (a, b) = (
            v["data_offsets"][0].as_u64().unwrap() as usize,
            v["data_offsets"][1].as_u64().unwrap() as usize,
        );
        if k == tensor {
            continue;
        }
        v["data_offsets"] = json!([bytes.len(), bytes.len() + b - a]);
        bytes.extend_from_slice(&data[a..b]);
        out.insert(k, v);
    }
    std::fs::write(&path, join(&Value::Object(out).to_string(), &bytes)).unwrap();
    if from_index {
        let ip = m.join("model.safetensors.index.json");
        let mut idx: Value = serde_json::from_slice(&std::fs::read(&ip).unwrap()).unwrap();
        idx["weight_map"].as_object_mut().unwrap().remove(tensor);
        std::fs::write(&ip, serde_json::to_vec(&idx).unwrap()).unwrap();
    }
}

// ---------------------------------------------------------------- class 5: panics

#[test]
fn vocab_size_zero_is_refused_by_run_and_bisect() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    set_config(&m, |c| c["vocab_size"] = json!(0));
    assert_refused(&run_small(&m, &[]), &["vocab_size", "config.json"]);
    let o = probe(
        &[
            "bisect",
            "--model",
            s(&m),
            "--backend",
            "cpu",
            "--layers",
            "0..2",
            "--seq-len",
            "16",
        ],
        Some(CAP),
    );
    assert_refused(&o, &["vocab_size", "config.json"]);
}

#[test]
fn seq_len_u64_max_is_refused() {
    let o = probe(
        &[
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "18446744073709551615",
        ],
        Some(CAP),
    );
    assert_refused(&o, &["--seq-len", "18446744073709551615"]);
}

// ---------------------------------------------------------------- class 6: memory

#[test]
fn num_hidden_layers_1e9_is_refused_by_run_and_bounded_in_inspect_and_lint() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    // no explicit schedule: the default one is built per layer, the allocation that aborted
    set_config(&m, |c| {
        c["num_hidden_layers"] = json!(1_000_000_000u64);
        c.as_object_mut().unwrap().remove("compress_ratios");
    });
    assert_refused(&run_small(&m, &[]), &["num_hidden_layers", "config.json"]);
    // inspect and lint still describe the tensors the checkpoint holds, within the cap; inspect
    // exits 2 as run does (issue 44)
    let o = probe(&["inspect", "--all", "--model", s(&m)], Some(CAP));
    assert_eq!(o.code, Some(2), "{}", o.all());
    assert!(o.stdout.contains("layers.2.attn.wq_a"), "{}", o.stdout);
    assert!(
        o.all().contains("num_hidden_layers"),
        "inspect must warn: {}",
        o.all()
    );
    let o = probe(&["lint", "--model", s(&m)], Some(CAP));
    assert_eq!(
        o.code,
        Some(1),
        "lint: an unusable config is an error: {}",
        o.all()
    );
    assert!(o.stdout.contains("num_hidden_layers"), "{}", o.all());
}

#[test]
fn n_routed_experts_1e9_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    set_config(&m, |c| c["n_routed_experts"] = json!(1_000_000_000u64));
    assert_refused(&run_small(&m, &[]), &["n_routed_experts", "config.json"]);
}

#[test]
fn hc_mult_1e6_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    set_config(&m, |c| c["hc_mult"] = json!(1_000_000));
    assert_refused(&run_small(&m, &[]), &["hc_mult", "config.json"]);
}

#[test]
fn top_k_1e15_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    set_config(&m, |c| {
        c["num_experts_per_tok"] = json!(1_000_000_000_000_000u64)
    });
    assert_refused(&run_small(&m, &[]), &["num_experts_per_tok", "config.json"]);
    // with as many experts, the expert count's own limit refuses it
    set_config(&m, |c| {
        c["n_routed_experts"] = json!(1_000_000_000_000_000u64)
    });
    assert_refused(&run_small(&m, &[]), &["n_routed_experts", "config.json"]);
}

#[test]
fn seq_len_1e6_and_1e10_are_refused_with_the_estimate() {
    for n in ["1000000", "10000000000"] {
        let o = probe(
            &[
                "run",
                "--backend",
                "cpu",
                "--layers",
                "0..1",
                "--seq-len",
                n,
                "--quiet",
            ],
            Some(CAP),
        );
        assert_refused(&o, &["--seq-len", n, "GiB", "estimate", "--max-mem"]);
    }
}

#[test]
fn a_100k_token_file_on_the_cpu_is_refused_before_it_allocates() {
    let d = tempfile::tempdir().unwrap();
    let toks = d.path().join("ids.json");
    let ids: Vec<u32> = (0..100_000u32).map(|i| i % 500).collect();
    std::fs::write(&toks, serde_json::to_vec(&ids).unwrap()).unwrap();
    let o = probe(
        &[
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..4",
            "--tokens",
            s(&toks),
            "--quiet",
        ],
        Some(CAP),
    );
    assert_refused(&o, &[s(&toks), "100000 tokens", "GiB", "estimate"]);
    // --max-mem sets the budget the estimate is held to: a small one refuses a small run
    let o = probe(
        &[
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "64",
            "--max-mem",
            "0.001",
            "--quiet",
        ],
        Some(CAP),
    );
    assert_refused(&o, &["--max-mem", "GiB"]);
    let o = probe(
        &[
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "64",
            "--max-mem",
            "4",
            "--quiet",
        ],
        Some(CAP),
    );
    assert_eq!(o.code, Some(0), "{}", o.all());
}

/// The run JSON of a short clean CPU run of the built-in model, to be edited.
fn small_run_json() -> Value {
    let st = tempfile::tempdir().unwrap();
    let j = st.path().join("r.json");
    let o = probe(
        &[
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "16",
            "--quiet",
            "--json",
            s(&j),
        ],
        Some(CAP),
    );
    assert_eq!(o.code, Some(0), "{}", o.all());
    serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap()
}

/// A run JSON with every amax at 1e308 (and one path at the f64 maximum).
fn huge_amax_run(dir: &Path) -> PathBuf {
    let out = dir.join("run.json");
    let mut v = small_run_json();
    for (i, op) in v["ops"].as_array_mut().unwrap().iter_mut().enumerate() {
        for p in ["oracle_fp32", "oracle_bf16", "served"] {
            if op["stats"][p].is_object() {
                op["stats"][p]["amax"] = json!(if i == 3 { f64::MAX } else { 1e308 });
            }
        }
    }
    std::fs::write(&out, serde_json::to_vec(&v).unwrap()).unwrap();
    out
}

#[test]
fn plot_of_amax_1e308_finishes_within_the_cap() {
    let d = tempfile::tempdir().unwrap();
    let run = huge_amax_run(d.path());
    let png = d.path().join("p.png");
    let o = probe(&["plot", s(&run), "--out", s(&png)], Some(CAP));
    assert_eq!(o.code, Some(0), "{}", o.all());
    assert!(d.path().join("p-amax.png").is_file());
}

// ---------------------------------------------------------------- class 7: hangs

#[test]
fn hc_sinkhorn_iters_1e12_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    set_config(&m, |c| c["hc_sinkhorn_iters"] = json!(1_000_000_000_000u64));
    assert_refused(&run_small(&m, &[]), &["hc_sinkhorn_iters", "config.json"]);
}

#[test]
fn plot_with_one_amax_of_1e308_does_not_hang() {
    let d = tempfile::tempdir().unwrap();
    let mut v = small_run_json();
    v["ops"][5]["stats"]["served"]["amax"] = json!(1e308);
    let run = d.path().join("one.json");
    std::fs::write(&run, serde_json::to_vec(&v).unwrap()).unwrap();
    let svg = d.path().join("p.svg");
    let o = probe(&["plot", s(&run), "--out", s(&svg)], Some(CAP));
    assert_eq!(o.code, Some(0), "{}", o.all());
    assert!(d.path().join("p-amax.svg").is_file());
}

#[cfg(unix)]
fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o644) }, 0, "mkfifo");
}

#[cfg(unix)]
#[test]
fn config_json_that_is_a_fifo_is_refused_without_blocking() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    std::fs::remove_file(m.join("config.json")).unwrap();
    mkfifo(&m.join("config.json"));
    for cmd in ["run", "inspect", "lint"] {
        let mut a = vec![cmd, "--model", s(&m)];
        if cmd == "run" {
            a.extend_from_slice(&["--backend", "cpu", "--seq-len", "8"]);
        }
        let o = probe(&a, Some(CAP));
        assert_refused(&o, &["config.json", "FIFO", "not a regular file"]);
    }
    // the other inputs a user names: a token list, a probe spec
    let fifo = d.path().join("ids.json");
    mkfifo(&fifo);
    for flag in ["--tokens", "--probe"] {
        let o = probe(
            &[
                "run",
                "--backend",
                "cpu",
                "--layers",
                "0..1",
                flag,
                s(&fifo),
            ],
            Some(CAP),
        );
        assert_refused(&o, &["ids.json", "FIFO"]);
    }
}

// ---------------------------------------------------------------- class 8: bad input accepted

#[test]
fn duplicate_safetensors_header_keys_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    let t = "layers.0.attn.wq_a.weight";
    let path = shard_of(&m, t);
    let (h, data) = split(&std::fs::read(&path).unwrap());
    // the entry again, pointing at another tensor's bytes of the same size: last one wins in serde
    let v: serde_json::Map<String, Value> = serde_json::from_str(&h).unwrap();
    let mine = &v[t];
    let other = v
        .iter()
        .find(|(k, e)| {
            *k != t && e.get("shape") == mine.get("shape") && e.get("dtype") == mine.get("dtype")
        })
        .map(|(_, e)| e.clone())
        .unwrap_or_else(|| mine.clone());
    let body = h.trim_end().strip_suffix('}').unwrap();
    let dup = format!("{body},\"{t}\":{other}}}");
    std::fs::write(&path, join(&dup, &data)).unwrap();
    let shard = path.file_name().unwrap().to_str().unwrap().to_string();
    for cmd in ["inspect", "lint"] {
        let o = probe(&[cmd, "--model", s(&m)], Some(CAP));
        assert_refused(&o, &[&shard, t, "twice"]);
    }
    assert_refused(&run_small(&m, &[]), &[&shard, t, "twice"]);
}

#[test]
fn config_fields_outside_the_family_are_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    let orig = config(&m);
    for (field, value) in [
        ("sliding_window", json!(0)),
        ("index_n_heads", json!(0)),
        ("index_n_heads", json!(1_000_000_000u64)),
        ("index_topk", json!(0)),
        ("compress_ratios", json!([0, 1_000_000_000u64, 4, 0])),
        ("num_hidden_layers", json!(0)),
    ] {
        std::fs::write(m.join("config.json"), orig.to_string()).unwrap();
        set_config(&m, |c| c[field] = value.clone());
        let o = run_small(&m, &[]);
        assert_refused(&o, &[field, "config.json"]);
        assert!(
            !o.stderr.contains("18446744073709551615"),
            "{field} = {value}: {}",
            o.stderr
        );
    }
}

#[test]
fn a_missing_expert_weight_is_reported_by_inspect_and_lint() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::ModelOptNvfp4);
    let gone = "layers.1.ffn.experts.3.w1";
    for suffix in ["weight", "weight_scale", "weight_scale_2", "input_scale"] {
        drop_tensor(&m, &format!("{gone}.{suffix}"), true);
    }
    let o = probe(&["lint", "--model", s(&m)], Some(CAP));
    assert_eq!(o.code, Some(1), "{}", o.all());
    assert!(
        o.stdout.contains(&format!("{gone}.weight")),
        "lint must name the missing weight: {}",
        o.stdout
    );
    let o = probe(&["inspect", "--model", s(&m)], Some(CAP));
    assert!(
        o.all().contains(&format!("{gone}.weight")) && o.all().contains("missing"),
        "inspect must name the missing weight: {}",
        o.all()
    );
}

#[test]
fn a_shard_tensor_the_index_omits_is_refused() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    let t = "layers.1.attn.wkv.weight";
    let ip = m.join("model.safetensors.index.json");
    let mut idx: Value = serde_json::from_slice(&std::fs::read(&ip).unwrap()).unwrap();
    idx["weight_map"].as_object_mut().unwrap().remove(t);
    std::fs::write(&ip, serde_json::to_vec(&idx).unwrap()).unwrap();
    for cmd in ["inspect", "lint"] {
        let o = probe(&[cmd, "--model", s(&m)], Some(CAP));
        assert_refused(&o, &["model.safetensors.index.json", t]);
    }
    assert_refused(&run_small(&m, &[]), &["model.safetensors.index.json", t]);
}

#[test]
fn plot_refuses_numbers_that_are_strings_as_gate_does() {
    let d = tempfile::tempdir().unwrap();
    let j = d.path().join("r.json");
    let o = probe(
        &[
            "run",
            "--backend",
            "cpu",
            "--layers",
            "0..1",
            "--seq-len",
            "16",
            "--quiet",
            "--json",
            s(&j),
        ],
        Some(CAP),
    );
    assert_eq!(o.code, Some(0), "{}", o.all());
    let mut v: Value = serde_json::from_slice(&std::fs::read(&j).unwrap()).unwrap();
    let id = v["ops"][4]["id"].as_str().unwrap().to_string();
    v["ops"][4]["stats"]["served"]["amax"] = json!("12.5");
    v["ops"][4]["served_isolated_vs_bf16"]["cos"] = json!("0.99");
    let bad = d.path().join("strings.json");
    std::fs::write(&bad, serde_json::to_vec(&v).unwrap()).unwrap();
    let o = probe(
        &["plot", s(&bad), "--out", s(&d.path().join("p.png"))],
        Some(CAP),
    );
    assert_refused(&o, &["strings.json", &id, "number"]);
    assert!(!d.path().join("p-amax.png").exists());
    let o = probe(
        &["gate", "--baseline", s(&j), "--current", s(&bad)],
        Some(CAP),
    );
    assert_refused(&o, &["strings.json", &id, "number"]);
}

// ---------------------------------------------------------------- class 9: messages

#[test]
fn a_bad_parameter_names_its_shard_file() {
    let d = tempfile::tempdir().unwrap();
    let m = model(d.path(), Format::Bf16);
    let t = "layers.0.attn.attn_sink";
    let path = shard_of(&m, t);
    let (h, data) = split(&std::fs::read(&path).unwrap());
    let mut v: serde_json::Map<String, Value> = serde_json::from_str(&h).unwrap();
    // the same 4·H bytes read as BF16 [2·H]: a parameter with the wrong element count
    let e = v.get_mut(t).unwrap();
    assert_eq!(e["dtype"], "F32");
    let n = e["shape"][0].as_u64().unwrap();
    e["dtype"] = json!("BF16");
    e["shape"] = json!([2 * n]);
    let out = v;
    std::fs::write(&path, join(&Value::Object(out).to_string(), &data)).unwrap();
    let o = run_small(&m, &[]);
    let shard = path.file_name().unwrap().to_str().unwrap();
    assert_refused(&o, &[shard, "attn_sink"]);
    assert!(!o.stderr.contains("(checkpoint)"), "{}", o.stderr);
}

#[cfg(unix)]
#[test]
fn shards_that_are_not_regular_files_say_what_they_are() {
    for (kind, want) in [
        ("loop", "symlink loop"),
        ("fifo", "FIFO"),
        ("zero", "character device"),
    ] {
        let d = tempfile::tempdir().unwrap();
        let m = model(d.path(), Format::Bf16);
        let shard = shard_of(&m, "layers.0.attn.wq_a.weight");
        std::fs::remove_file(&shard).unwrap();
        match kind {
            "loop" => std::os::unix::fs::symlink(&shard, &shard).unwrap(),
            "fifo" => mkfifo(&shard),
            _ => std::os::unix::fs::symlink("/dev/zero", &shard).unwrap(),
        }
        let name = shard.file_name().unwrap().to_str().unwrap();
        for cmd in ["inspect", "lint"] {
            let o = probe(&[cmd, "--model", s(&m)], Some(CAP));
            assert_refused(&o, &[name, want]);
            assert!(!o.stderr.contains("does not exist"), "{kind}: {}", o.stderr);
        }
    }
}

/// The completeness check reports nothing on complete checkpoints: every synthetic format in both
/// namings, and the transformers-made checkpoint.
#[test]
fn complete_checkpoints_miss_nothing() {
    use nvfp4_probe::checkpoint::Checkpoint;
    for format in [
        Format::Bf16,
        Format::CtNvfp4,
        Format::ModelOptNvfp4,
        Format::OfficialMixed,
        Format::Mxfp4,
    ] {
        for naming in [Naming::Official, Naming::Hf] {
            let d = tempfile::tempdir().unwrap();
            let mut so = SynthOptions::new(Preset::Tiny, format, naming, 0);
            so.layers = Some(3);
            synth_to_dir(&so, d.path()).unwrap();
            let ck = Checkpoint::open(d.path()).unwrap();
            assert_eq!(ck.missing_tensors(), vec![], "{format:?} {naming:?}");
        }
    }
    let hf = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-tiny");
    let ck = Checkpoint::open(&hf).unwrap();
    assert_eq!(ck.missing_tensors(), vec![]);
}
