//! Fuzzing of every reader of user input, by proptest-driven mutation (cargo-fuzz needs nightly,
//! which CI does not have): safetensors headers and the shard index, config.json, run JSON (the
//! gate's and plot's one reader) and trace files. Each mutated input must give `Ok` or a clean
//! `Error` — never a panic (proptest fails the case and shrinks it) — within a time bound, and
//! whatever parses is then used the way the commands use it (lint, the memory estimate, the op
//! graph, the gate, the plots). Cases per test: `NVFP4_PROBE_FUZZ_CASES` (default below, sized to
//! keep each test well under 20 s in release on 2 cores).

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nvfp4_probe::checkpoint::{Checkpoint, Naming};
use nvfp4_probe::gate::{self, Tolerances};
use nvfp4_probe::model::graph::{build_graph, layer_graph};
use nvfp4_probe::model::ModelConfig;
use nvfp4_probe::probe::budget::{estimate, Plan};
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions};
use nvfp4_probe::synth::{synth_to_dir, Format, Preset, SynthOptions};
use nvfp4_probe::trace::read::Trace;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestRunner};
use serde_json::{json, Value};

/// One input may take this long at most (generous: the machine is shared).
const CASE_LIMIT: Duration = Duration::from_secs(10);

fn cases(default: u32) -> u32 {
    std::env::var("NVFP4_PROBE_FUZZ_CASES")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(default)
}

fn runner(n: u32) -> TestRunner {
    TestRunner::new(Config {
        cases: cases(n),
        failure_persistence: None,
        ..Config::default()
    })
}

#[track_caller]
fn within_limit(t0: Instant, what: &str) {
    let e = t0.elapsed();
    assert!(e < CASE_LIMIT, "{what} took {e:?}");
}

// ---------------------------------------------------------------- mutations

/// One edit of a byte string. Positions are taken modulo the edited region.
#[derive(Clone, Debug)]
enum Edit {
    Set(usize, u8),
    Flip(usize, u8),
    Insert(usize, Vec<u8>),
    Delete(usize, usize),
    Truncate(usize),
}

/// Tokens that make JSON and numbers interesting.
const TOKENS: &[&str] = &[
    "0",
    "-1",
    "1e308",
    "-1e308",
    "18446744073709551615",
    "99999999999999999999",
    "1.5",
    "null",
    "true",
    "\"",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"x\"",
    "NaN",
    "\\u0000",
    "{}",
    "[]",
    "\"F32\"",
    "\"U8\"",
    "\"BF16\"",
    "\"F8_E4M3\"",
    "[0,0]",
    "[1,2,3]",
];

fn edit() -> impl Strategy<Value = Edit> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(p, b)| Edit::Set(p, b)),
        (any::<usize>(), 0u8..8).prop_map(|(p, b)| Edit::Flip(p, b)),
        (any::<usize>(), 0..TOKENS.len())
            .prop_map(|(p, t)| Edit::Insert(p, TOKENS[t].as_bytes().to_vec())),
        (any::<usize>(), prop::collection::vec(any::<u8>(), 1..4))
            .prop_map(|(p, v)| Edit::Insert(p, v)),
        (any::<usize>(), 1usize..16).prop_map(|(p, n)| Edit::Delete(p, n)),
        any::<usize>().prop_map(Edit::Truncate),
    ]
}

fn edits() -> impl Strategy<Value = Vec<Edit>> {
    prop::collection::vec(edit(), 1..6)
}

/// Apply edits to `b[start..end]` (end grows or shrinks with them).
fn apply(b: &mut Vec<u8>, start: usize, mut end: usize, edits: &[Edit]) {
    for e in edits {
        let len = end.saturating_sub(start).max(1);
        let at = |p: usize| start + p % len;
        match e {
            Edit::Set(p, v) if end > start => b[at(*p)] = *v,
            Edit::Flip(p, bit) if end > start => b[at(*p)] ^= 1 << bit,
            Edit::Insert(p, v) => {
                let i = at(*p).min(b.len());
                b.splice(i..i, v.iter().copied());
                end += v.len();
            }
            Edit::Delete(p, n) if end > start => {
                let i = at(*p);
                let j = (i + n).min(end).min(b.len());
                b.drain(i..j);
                end -= j - i;
            }
            Edit::Truncate(p) => {
                let n = start + p % (b.len() - start + 1);
                b.truncate(n);
                end = end.min(n);
            }
            _ => {}
        }
    }
}

/// The header JSON of a safetensors file and its data.
fn split(bytes: &[u8]) -> (Vec<u8>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    (bytes[8..8 + n].to_vec(), bytes[8 + n..].to_vec())
}

fn join(header: &[u8], data: &[u8]) -> Vec<u8> {
    let mut out = (header.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(header);
    out.extend_from_slice(data);
    out
}

/// Mutate a safetensors file: its header text with the length field kept right (so the JSON
/// and the entries are what gets exercised), or its raw first bytes (length field included).
fn mutate_safetensors(file: &[u8], text_mode: bool, e: &[Edit]) -> Vec<u8> {
    if text_mode {
        let (mut h, data) = split(file);
        let n = h.len();
        apply(&mut h, 0, n, e);
        join(&h, &data)
    } else {
        let mut b = file.to_vec();
        let n = 8 + u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
        let end = (n + 16).min(b.len());
        apply(&mut b, 0, end, e);
        b
    }
}

/// A change to one header entry that keeps the JSON (and often the file) valid, so that what
/// lies behind the safetensors checks is reached: dtypes of the same width, shapes with the same
/// element count, offsets swapped between entries, renamed or dropped entries, odd values.
#[derive(Clone, Debug)]
enum EntryEdit {
    Dtype(usize),
    Reshape(u8),
    SwapOffsets(usize),
    Rename(usize),
    Drop,
    Field(u8, usize),
}

fn entry_edit() -> impl Strategy<Value = EntryEdit> {
    prop_oneof![
        any::<usize>().prop_map(EntryEdit::Dtype),
        (0u8..4).prop_map(EntryEdit::Reshape),
        any::<usize>().prop_map(EntryEdit::SwapOffsets),
        any::<usize>().prop_map(EntryEdit::Rename),
        Just(EntryEdit::Drop),
        (0u8..3, 0..TOKENS.len()).prop_map(|(f, t)| EntryEdit::Field(f, t)),
    ]
}

/// Dtypes by element width in bits.
const SAME_WIDTH: &[&[&str]] = &[
    &["F32", "I32", "U32"],
    &["BF16", "F16", "I16", "U16"],
    &["U8", "I8", "F8_E4M3", "F8_E5M2", "F8_E8M0", "BOOL"],
    &["F64", "I64", "U64"],
];

/// Apply `edits` to entry `which` (by index among the tensors) of a safetensors header.
fn mutate_entries(file: &[u8], edits: &[(usize, EntryEdit)]) -> Vec<u8> {
    let (h, data) = split(file);
    let mut v: serde_json::Map<String, Value> = match serde_json::from_slice(&h) {
        Ok(v) => v,
        Err(_) => return file.to_vec(),
    };
    for (which, e) in edits {
        let names: Vec<String> = v.keys().filter(|k| *k != "__metadata__").cloned().collect();
        if names.is_empty() {
            break;
        }
        let name = names[which % names.len()].clone();
        match e {
            EntryEdit::Dtype(k) => {
                let dt = v[&name]["dtype"].as_str().unwrap_or("").to_string();
                if let Some(g) = SAME_WIDTH.iter().find(|g| g.contains(&dt.as_str())) {
                    v[&name]["dtype"] = json!(g[k % g.len()]);
                }
            }
            EntryEdit::Reshape(kind) => {
                let shape: Vec<u64> = v[&name]["shape"]
                    .as_array()
                    .map(|a| a.iter().filter_map(Value::as_u64).collect())
                    .unwrap_or_default();
                let n: u64 = shape.iter().product();
                let new: Vec<u64> = match kind {
                    0 => shape.iter().rev().copied().collect(),
                    1 => vec![n],
                    2 => [vec![1], shape.clone()].concat(),
                    _ => vec![],
                };
                v[&name]["shape"] = json!(new);
            }
            EntryEdit::SwapOffsets(k) => {
                let other = names[k % names.len()].clone();
                let a = v[&name]["data_offsets"].clone();
                let b = v[&other]["data_offsets"].clone();
                v[&name]["data_offsets"] = b;
                v[&other]["data_offsets"] = a;
            }
            EntryEdit::Rename(k) => {
                let e = v.remove(&name).unwrap_or(Value::Null);
                let to = match k % 3 {
                    0 => names[k % names.len()].clone(),
                    1 => format!("{name}.x"),
                    _ => name.replace("layers.1", "layers.7"),
                };
                v.insert(to, e);
            }
            EntryEdit::Drop => {
                v.remove(&name);
            }
            EntryEdit::Field(f, t) => {
                let key = ["dtype", "shape", "data_offsets"][*f as usize];
                v[&name][key] = serde_json::from_str(TOKENS[*t]).unwrap_or(json!(TOKENS[*t]));
            }
        }
    }
    join(Value::Object(v).to_string().as_bytes(), &data)
}

// ---------------------------------------------------------------- fixtures

/// A tiny synthetic checkpoint (3 layers, ModelOpt NVFP4 experts + FP8 attention: every scale
/// kind lint reads; two shards and an index) as in-memory files: config text and (name, bytes) incl. the index.
struct Files {
    config: String,
    files: Vec<(String, Vec<u8>)>,
}

fn checkpoint_files() -> &'static Files {
    static F: OnceLock<Files> = OnceLock::new();
    F.get_or_init(|| {
        let d = tempfile::tempdir().unwrap();
        let mut so = SynthOptions::new(Preset::Tiny, Format::ModelOptNvfp4, Naming::Official, 0);
        so.layers = Some(3);
        synth_to_dir(&so, d.path()).unwrap();
        let mut files = Vec::new();
        let mut config = String::new();
        let mut names: Vec<PathBuf> = std::fs::read_dir(d.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        names.sort();
        for p in names {
            let name = p.file_name().unwrap().to_str().unwrap().to_string();
            let bytes = std::fs::read(&p).unwrap();
            if name == "config.json" {
                config = String::from_utf8(bytes).unwrap();
            } else if name.ends_with(".safetensors") || name.ends_with(".index.json") {
                files.push((name, bytes));
            }
        }
        assert!(files.len() >= 2, "a sharded checkpoint with an index");
        Files { config, files }
    })
}

/// Everything the commands do with a checkpoint, short of running it: must not panic. Returns
/// whether it opened (the tests report how many inputs got that far).
fn exercise_checkpoint(config: &str, files: Vec<(String, Vec<u8>)>) -> bool {
    let Ok(ck) = Checkpoint::from_memory(config, files) else {
        return false;
    };
    let _ = ck.model_config();
    let _ = ck.missing_tensors();
    for n in ck.canonical_names().iter().take(8) {
        let _ = ck.tensor_f32(n);
    }
    for b in ck.weight_bases() {
        if let Ok(m) = ck.weight_meta(&b) {
            let _ = ck.scale_summary(&m);
        }
    }
    let _ = nvfp4_probe::lint::lint(&ck, &nvfp4_probe::lint::Rules::default());
    true
}

/// Counts inputs that got past parsing, printed at the end of a test: a fuzzer whose inputs all
/// fail at the first check exercises nothing behind it.
#[derive(Default)]
struct Reach(
    std::sync::atomic::AtomicUsize,
    std::sync::atomic::AtomicUsize,
);

impl Reach {
    fn saw(&self, deep: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        self.0.fetch_add(1, Relaxed);
        if deep {
            self.1.fetch_add(1, Relaxed);
        }
    }
    fn report(&self, what: &str) {
        use std::sync::atomic::Ordering::Relaxed;
        let (n, d) = (self.0.load(Relaxed), self.1.load(Relaxed));
        eprintln!("{what}: {d} of {n} inputs parsed and were used");
        assert!(n == 0 || d > 0, "{what}: no input got past parsing");
    }
}

// ---------------------------------------------------------------- targets

#[test]
fn fuzz_safetensors_headers() {
    let f = checkpoint_files();
    let shards: Vec<usize> = (0..f.files.len())
        .filter(|&i| f.files[i].0.ends_with(".safetensors"))
        .collect();
    let reach = Reach::default();
    let entry_edits = prop::collection::vec((any::<usize>(), entry_edit()), 1..4);
    runner(256)
        .run(
            &(0..shards.len(), 0..4u8, edits(), entry_edits),
            |(which, mode, e, ee)| {
                let mut files = f.files.clone();
                let i = shards[which];
                files[i].1 = match mode {
                    0 => mutate_safetensors(&files[i].1, false, &e),
                    1 => mutate_safetensors(&files[i].1, true, &e),
                    _ => mutate_entries(&files[i].1, &ee),
                };
                let t0 = Instant::now();
                reach.saw(exercise_checkpoint(&f.config, files));
                within_limit(t0, "a mutated shard");
                Ok(())
            },
        )
        .unwrap();
    reach.report("safetensors headers");
}

#[test]
fn fuzz_the_shard_index() {
    let f = checkpoint_files();
    let idx = f
        .files
        .iter()
        .position(|(n, _)| n.ends_with(".index.json"))
        .unwrap();
    let v: Value = serde_json::from_slice(&f.files[idx].1).unwrap();
    let names: Vec<String> = v["weight_map"]
        .as_object()
        .unwrap()
        .keys()
        .cloned()
        .collect();
    let shards: Vec<String> = f
        .files
        .iter()
        .filter(|(n, _)| n.ends_with(".safetensors"))
        .map(|(n, _)| n.clone())
        .collect();
    let reach = Reach::default();
    // text edits, and structured ones: a tensor moved, dropped or added, a shard renamed
    let structured = (0..names.len(), 0..4u8, 0..shards.len(), 0..TOKENS.len());
    runner(128)
        .run(
            &(any::<bool>(), edits(), structured),
            |(text_mode, e, (t, kind, s, tok))| {
                let mut files = f.files.clone();
                if text_mode {
                    let n = files[idx].1.len();
                    apply(&mut files[idx].1, 0, n, &e);
                } else {
                    let mut v = v.clone();
                    let wm = v["weight_map"].as_object_mut().unwrap();
                    match kind {
                        0 => {
                            wm.insert(names[t].clone(), json!(shards[s]));
                        }
                        1 => {
                            wm.remove(&names[t]);
                        }
                        2 => {
                            wm.insert(format!("{}.ghost", names[t]), json!(shards[s]));
                        }
                        _ => {
                            let bad: Value =
                                serde_json::from_str(TOKENS[tok]).unwrap_or(json!(TOKENS[tok]));
                            wm.insert(names[t].clone(), bad);
                        }
                    }
                    files[idx].1 = serde_json::to_vec(&v).unwrap();
                }
                let t0 = Instant::now();
                reach.saw(exercise_checkpoint(&f.config, files));
                within_limit(t0, "a mutated index");
                Ok(())
            },
        )
        .unwrap();
    reach.report("index");
}

/// Values that stress a config field: zero, negatives, limits of u64/f64, wrong types.
fn interesting() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(json!(0)),
        Just(json!(1)),
        Just(json!(-1)),
        Just(json!(3)),
        Just(json!(4)),
        Just(json!(1_000_000)),
        Just(json!(1_000_000_000_000u64)),
        Just(json!(u64::MAX)),
        Just(json!(1e308)),
        Just(json!(-1e308)),
        Just(json!(0.5)),
        Just(json!("12")),
        Just(Value::Null),
        Just(json!(true)),
        Just(json!([])),
        Just(json!({})),
        Just(json!([0, 4, 128, 1_000_000_000u64])),
        Just(json!([
            "sliding_attention",
            "compressed_sparse_attention",
            "bogus"
        ])),
        Just(json!({"compressed_sparse_attention": 8, "heavily_compressed_attention": 4})),
        Just(json!({"type": "yarn", "factor": 0, "beta_fast": 1e308})),
        (0u64..20_000).prop_map(|n| json!(n)),
    ]
}

const CONFIG_KEYS: &[&str] = &[
    "hidden_size",
    "num_hidden_layers",
    "vocab_size",
    "num_attention_heads",
    "head_dim",
    "qk_rope_head_dim",
    "q_lora_rank",
    "o_groups",
    "o_lora_rank",
    "sliding_window",
    "compress_ratios",
    "rope_theta",
    "compress_rope_theta",
    "rope_scaling",
    "rms_norm_eps",
    "hc_mult",
    "hc_sinkhorn_iters",
    "hc_eps",
    "n_routed_experts",
    "num_experts_per_tok",
    "n_shared_experts",
    "moe_intermediate_size",
    "num_hash_layers",
    "routed_scaling_factor",
    "scoring_func",
    "swiglu_limit",
    "index_n_heads",
    "index_head_dim",
    "index_topk",
    "layer_types",
    "compress_rates",
    "mlp_layer_types",
    "partial_rotary_factor",
    "rope_parameters",
    "n_layers",
    "dim",
    "quantization_config",
];

/// What the commands build from a config that parsed: all of it must be panic-free and bounded.
fn exercise_config(cfg: &ModelConfig, tokens: u64) {
    cfg.validate().expect("a parsed config validates");
    let last = cfg.num_hidden_layers - 1;
    for device in [false, true] {
        let e = estimate(
            cfg,
            &Plan {
                layers: (0, last),
                tokens,
                keep_outputs: tokens.is_multiple_of(2),
                kept_rows: None,
                with_head: true,
                layer_states: tokens.is_multiple_of(3),
                device,
                chunk: tokens.is_multiple_of(5).then_some(7),
            },
        );
        assert!(e.host() >= 0.0 && !e.host().is_nan(), "{e:?}");
    }
    // the graph of a few layers (the budget check refuses what would not fit before a run does)
    if cfg.n_routed_experts <= 512 {
        let ops = build_graph(cfg, last.min(3), true);
        assert!(!ops.is_empty());
    }
    for l in [0, last] {
        let _ = layer_graph(cfg, l);
    }
}

#[test]
fn fuzz_config_json() {
    let f = checkpoint_files();
    let hf = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/hf-tiny/config.json"),
    )
    .unwrap();
    let bases = [f.config.clone(), hf];
    let reach = Reach::default();
    let (runs, ran) = (
        std::sync::atomic::AtomicUsize::new(0),
        std::sync::atomic::AtomicUsize::new(0),
    );
    runner(512)
        .run(
            &(
                0..2usize,
                any::<bool>(),
                edits(),
                prop::collection::vec((0..CONFIG_KEYS.len(), interesting()), 1..4),
                1u64..100_000,
            ),
            |(which, text_mode, e, sets, tokens)| {
                let text = if text_mode {
                    let mut b = bases[which].clone().into_bytes();
                    let n = b.len();
                    apply(&mut b, 0, n, &e);
                    String::from_utf8_lossy(&b).into_owned()
                } else {
                    let mut v: Value = serde_json::from_str(&bases[which]).unwrap();
                    for (k, val) in sets {
                        v[CONFIG_KEYS[k]] = val;
                    }
                    v.to_string()
                };
                let t0 = Instant::now();
                let mut deep = false;
                if let Ok(v) =
                    nvfp4_probe::input::parse_json(Path::new("config.json"), &text, "config")
                {
                    if let Ok(cfg) = ModelConfig::from_json(&v) {
                        exercise_config(&cfg, tokens);
                        deep = true;
                    }
                }
                reach.saw(deep);
                // the same text as a checkpoint's config (open, lint, completeness), and a short
                // run of its first layer for the first configs that open (the op math must turn
                // whatever the limits let through into numbers or clean errors)
                if which == 0 && exercise_checkpoint(&text, f.files.clone()) {
                    use std::sync::atomic::Ordering::Relaxed;
                    if runs.fetch_add(1, Relaxed) < 24 {
                        let ck = Checkpoint::from_memory(&text, f.files.clone()).unwrap();
                        if let Ok(cfg) = ck.model_config() {
                            let toks = synthetic_tokens(12, cfg.vocab_size, 0);
                            if run(&ck, &RunOptions::new((0, 0), toks)).is_ok() {
                                ran.fetch_add(1, Relaxed);
                            }
                        }
                    }
                }
                within_limit(t0, "a mutated config");
                Ok(())
            },
        )
        .unwrap();
    reach.report("config.json");
    eprintln!(
        "config.json: {} of {} runs of mutated configs completed",
        ran.load(std::sync::atomic::Ordering::Relaxed),
        runs.load(std::sync::atomic::Ordering::Relaxed).min(24)
    );
}

fn base_run() -> &'static (String, Value) {
    static R: OnceLock<(String, Value)> = OnceLock::new();
    R.get_or_init(|| {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/gate/base.json");
        let t = std::fs::read_to_string(p).unwrap();
        let v = serde_json::from_str(&t).unwrap();
        (t, v)
    })
}

/// Replace the `k`-th leaf (in document order) with `val`.
fn set_leaf(v: &mut Value, k: &mut usize, val: &Value) -> bool {
    match v {
        Value::Object(m) => m.values_mut().any(|c| set_leaf(c, k, val)),
        Value::Array(a) => a.iter_mut().any(|c| set_leaf(c, k, val)),
        leaf => {
            if *k == 0 {
                *leaf = val.clone();
                true
            } else {
                *k -= 1;
                false
            }
        }
    }
}

#[test]
fn fuzz_run_json_for_gate_and_plot() {
    let (text, base) = base_run();
    let out = tempfile::tempdir().unwrap();
    let leaves = {
        let mut k = usize::MAX;
        set_leaf(&mut base.clone(), &mut k, &Value::Null);
        usize::MAX - k
    };
    let reach = Reach::default();
    runner(96)
        .run(
            &(
                any::<bool>(),
                edits(),
                prop::collection::vec((0..leaves, interesting()), 1..6),
            ),
            |(text_mode, e, sets)| {
                let cur = if text_mode {
                    let mut b = text.clone().into_bytes();
                    let n = b.len();
                    apply(&mut b, 0, n, &e);
                    String::from_utf8_lossy(&b).into_owned()
                } else {
                    let mut v = base.clone();
                    for (mut k, val) in sets {
                        set_leaf(&mut v, &mut k, &val);
                    }
                    v.to_string()
                };
                let t0 = Instant::now();
                let parsed = nvfp4_probe::run_json::parse_run(&cur, "cur.json");
                if let Ok(v) = &parsed {
                    let _ = gate::compare(base, v, &Tolerances::default(), true);
                    let _ = gate::compare(v, base, &Tolerances::default(), true);
                    nvfp4_probe::plot::plot_value(v, &out.path().join("p.svg"))
                        .expect("a run JSON the reader accepts plots");
                }
                reach.saw(parsed.is_ok());
                within_limit(t0, "a mutated run JSON");
                Ok(())
            },
        )
        .unwrap();
    reach.report("run JSON");
}

#[test]
fn fuzz_trace_files() {
    let src = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/synth-hf-trace-150.safetensors"),
    )
    .unwrap();
    let d = tempfile::tempdir().unwrap();
    let reach = Reach::default();
    let entry_edits = prop::collection::vec((any::<usize>(), entry_edit()), 1..4);
    runner(192)
        .run(&(0..4u8, edits(), entry_edits), |(mode, e, ee)| {
            let p = d.path().join("trace-rank0.safetensors");
            let bytes = match mode {
                0 => mutate_safetensors(&src, false, &e),
                1 => mutate_safetensors(&src, true, &e),
                _ => mutate_entries(&src, &ee),
            };
            std::fs::write(&p, bytes).unwrap();
            let t0 = Instant::now();
            let opened = Trace::open(&p);
            if let Ok(t) = &opened {
                let _ = t.names();
                let _ = t.rows();
                let _ = t.tokens();
                let _ = t.metadata();
            }
            reach.saw(opened.is_ok());
            within_limit(t0, "a mutated trace file");
            Ok(())
        })
        .unwrap();
    reach.report("trace files");
}
