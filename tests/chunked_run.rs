//! `--chunk` / `--mem-gib`: each layer over the prompt in token chunks (`probe::chunked`: the
//! window's KV rows, the compressors' pending rows and the compressed keys carried from chunk to
//! chunk) gives the same bits as the whole prompt at once. The built-in model over 300 tokens
//! covers every attention kind (window only, HCA ratio 128 with two complete blocks and a tail
//! past the last one, CSA ratio 4 with the indexer really selecting: 75 compressed rows >
//! index_topk); chunk sizes on and off the ratios' multiples (7, 64, 128, 129), a last chunk
//! past the last whole block. Every op's record, the summary and every kept output of every path
//! (whole, and `--dump-rows`' rows) must equal the unchunked run's.

use assert_cmd::Command;
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions, RunResult};

fn bin() -> Command {
    Command::cargo_bin("nvfp4-probe").unwrap()
}

fn run_with(chunk: Option<usize>) -> RunResult {
    run_rows(chunk, None)
}

fn run_rows(chunk: Option<usize>, rows: Option<Vec<usize>>) -> RunResult {
    let ck = nvfp4_probe::synth::builtin(0).expect("built-in model");
    let cfg = ck.model_config().expect("config").clone();
    let opts = RunOptions {
        keep_outputs: true,
        keep_rows: rows,
        chunk,
        ..RunOptions::new((0, 4), synthetic_tokens(300, cfg.vocab_size, 5))
    };
    run(&ck, &opts).expect("run")
}

/// Every record, the summary and every kept output of `r` equal `whole`'s, bit for bit.
fn assert_same(r: &RunResult, whole: &RunResult, what: &str) {
    assert_eq!(
        serde_json::to_value(&r.summary).unwrap(),
        serde_json::to_value(&whole.summary).unwrap(),
        "{what}: summary"
    );
    let (got, recs) = (
        serde_json::to_value(&r.records).unwrap(),
        serde_json::to_value(&whole.records).unwrap(),
    );
    assert_eq!(
        got.as_array().unwrap().len(),
        recs.as_array().unwrap().len()
    );
    for (a, b) in got.as_array().unwrap().iter().zip(recs.as_array().unwrap()) {
        assert_eq!(a, b, "{what}: record of {}", b["id"]);
    }
    assert_eq!(r.outputs.len(), whole.outputs.len());
    for (path, outs) in &whole.outputs {
        let mine = &r.outputs[path];
        assert_eq!(mine.len(), outs.len());
        for ((ia, ta), (ib, tb)) in mine.iter().zip(outs) {
            assert_eq!(ia, ib);
            assert_eq!(ta.shape, tb.shape, "{what}: {path} {ia}");
            let differ = ta
                .data
                .iter()
                .zip(tb.data.iter())
                .filter(|(x, y)| x.to_bits() != y.to_bits())
                .count();
            assert_eq!(differ, 0, "{what}: {path} {ia}: {differ} values differ");
        }
    }
}

#[test]
fn dumped_rows_of_a_chunked_run_equal_the_whole_runs() {
    // rows in several chunks, at a chunk's edges and inside a compressed block
    let rows = vec![0usize, 6, 7, 128, 130, 255, 256, 299];
    let whole = run_rows(None, Some(rows.clone()));
    for chunk in [7usize, 128] {
        assert_same(
            &run_rows(Some(chunk), Some(rows.clone())),
            &whole,
            &format!("rows, chunk {chunk}"),
        );
    }
}

#[test]
fn layers_in_token_chunks_equal_the_whole_prompt_in_every_record_and_output() {
    let whole = run_with(None);
    assert!(
        whole
            .records
            .iter()
            .any(|r| r.id.ends_with(".attn.indexer")),
        "the run has a CSA layer"
    );
    for chunk in [7usize, 64, 128, 129] {
        assert_same(&run_with(Some(chunk)), &whole, &format!("chunk {chunk}"));
    }
}

/// The other model families in token chunks: their attention carries the keys and values its
/// later queries reach (Qwen3-MoE's GQA, DeepSeek-V3's MLA keys, gpt-oss's sliding window of 16
/// and its full layers, with sinks), RoPE takes the chunk's positions; every record and output
/// equals the whole prompt's, in NVFP4 as the releases store it.
#[test]
fn each_model_family_in_token_chunks_equals_the_whole_prompt() {
    use nvfp4_probe::model::family::Kind;
    use nvfp4_probe::synth::{synth_to_memory, Format, SynthOptions};
    for (kind, format) in [
        (Kind::Qwen3Moe, Format::CtNvfp4),
        (Kind::DeepseekV3, Format::ModelOptNvfp4),
        (Kind::GptOss, Format::Mxfp4),
    ] {
        let ck = synth_to_memory(&SynthOptions::family(kind, format, 2)).expect("synth");
        let cfg = ck.model_config().expect("config").clone();
        let run_family = |chunk: Option<usize>| {
            let opts = RunOptions {
                keep_outputs: true,
                chunk,
                ..RunOptions::new(
                    (0, cfg.num_hidden_layers - 1),
                    synthetic_tokens(40, cfg.vocab_size, 4),
                )
            };
            run(&ck, &opts).expect("run")
        };
        let whole = run_family(None);
        for chunk in [5usize, 16, 17] {
            assert_same(
                &run_family(Some(chunk)),
                &whole,
                &format!("{kind:?}, chunk {chunk}"),
            );
        }
    }
}

#[test]
fn a_budget_too_small_for_one_chunk_exits_2_naming_the_smallest() {
    let out = bin()
        .args(["run", "--quiet", "--seq-len", "300", "--mem-gib", "0.00001"])
        .assert()
        .code(2)
        .get_output()
        .clone();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("smallest workable budget is --mem-gib"),
        "{err}"
    );
    let named = err
        .rsplit("--mem-gib ")
        .next()
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no budget in: {err}"));
    // the budget it names runs (one query token per chunk would be slow: a short prompt)
    bin()
        .args(["run", "--quiet", "--layers", "0..1", "--seq-len", "300"])
        .args(["--mem-gib", &format!("{named}")])
        .assert()
        .code(0);
    bin()
        .args(["run", "--quiet", "--chunk", "0"])
        .assert()
        .code(2);
}

#[test]
fn a_fault_in_a_chunked_run_diverges_where_it_does_whole_and_says_it_was_not_followed() {
    use nvfp4_probe::served::faults::Fault;
    let ck = nvfp4_probe::synth::builtin(0).expect("built-in model");
    let cfg = ck.model_config().expect("config").clone();
    let toks = synthetic_tokens(64, cfg.vocab_size, 3);
    let with = |chunk: Option<usize>| {
        let opts = RunOptions {
            loader_faults: vec![Fault::parse("inverted-input-scale@L3.ffn.experts").unwrap()],
            chunk,
            ..RunOptions::new((0, 4), toks.clone())
        };
        run(&ck, &opts).expect("run")
    };
    let (whole, chunked) = (with(None), with(Some(24)));
    let divergent = |r: &RunResult| -> Vec<(String, Option<f64>)> {
        r.records
            .iter()
            .filter(|x| x.divergent)
            .map(|x| (x.id.clone(), x.served_isolated_vs_bf16.rel_l2))
            .collect()
    };
    assert!(!divergent(&whole).is_empty());
    assert_eq!(divergent(&chunked), divergent(&whole));
    let first = chunked.records.iter().find(|r| r.divergent).unwrap();
    let why = serde_json::to_string(&first.consequence).unwrap();
    assert!(
        why.contains("token chunks") && why.contains("harmful"),
        "{why}"
    );
}
