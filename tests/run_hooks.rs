//! What the CUDA run's loader and prefetcher plan from before the run (`backend::run`:
//! `hash_routing`, `stage_groups`; `model::graph`: `reads_nothing` and its two cases), checked
//! against what a run itself does on the CPU: the experts the routers choose, the ops that read
//! weights.

use nvfp4_probe::backend::run::{hash_routing, stage_groups};
use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::model::graph::{
    build_graph, compressor_reads_nothing, indexer_reads_nothing, reads_nothing, Op, OpKind,
};
use nvfp4_probe::model::ModelConfig;
use nvfp4_probe::probe::{run, synthetic_tokens, RunOptions};

fn tiny() -> (Checkpoint, ModelConfig) {
    let ck = nvfp4_probe::synth::builtin(0).expect("built-in model");
    let cfg = ck.model_config().expect("config").clone();
    (ck, cfg)
}

#[test]
fn hash_routing_known_before_the_run_is_what_the_routers_choose() {
    let (ck, cfg) = tiny();
    assert!(
        cfg.num_hash_layers > 0,
        "the tiny model has hash-routed layers"
    );
    let last = cfg.num_hash_layers.min(cfg.num_hidden_layers - 1);
    let tokens = synthetic_tokens(48, cfg.vocab_size, 7);
    let ops = build_graph(&cfg, last, false);
    let early = hash_routing(&ck, &cfg, &ops, &tokens);
    assert_eq!(early.len(), cfg.num_hash_layers.min(last + 1));
    let mut opts = RunOptions::new((0, last), tokens);
    opts.keep_outputs = true;
    let r = run(&ck, &opts).expect("run");
    for (target, used) in &early {
        // the router whose expert ids the experts op at `target` consumes
        let router = ops
            .iter()
            .find(|o| {
                o.kind == OpKind::Router
                    && o.outputs
                        .get(1)
                        .is_some_and(|id| ops[*target].inputs.contains(id))
            })
            .expect("router of the experts op");
        let idx_id = &router.outputs[1];
        let mut chosen = vec![false; used.len()];
        for path in ["oracle_fp32", "oracle_bf16", "served"] {
            let (_, t) = r.outputs[path]
                .iter()
                .find(|(id, _)| id == idx_id)
                .expect("router ids kept");
            for &v in t.data.iter() {
                chosen[v as usize] = true;
            }
        }
        assert_eq!(&chosen, used, "experts of {}", ops[*target].id);
        assert!(used.iter().any(|&u| u));
    }
}

#[test]
fn indexers_left_out_of_the_plan_read_no_weight() {
    let (ck, cfg) = tiny();
    let ops = build_graph(&cfg, cfg.num_hidden_layers - 1, false);
    let indexers: Vec<&Op> = ops.iter().filter(|o| o.kind == OpKind::Indexer).collect();
    assert!(!indexers.is_empty(), "the tiny model has indexers");
    let mut seen = (false, false);
    for t in [12, 64] {
        let opts = RunOptions::new(
            (0, cfg.num_hidden_layers - 1),
            synthetic_tokens(t, cfg.vocab_size, 3),
        );
        let r = run(&ck, &opts).expect("run");
        for op in &indexers {
            let rec = r
                .records
                .iter()
                .find(|x| x.id == op.id)
                .expect("indexer record");
            let skip = indexer_reads_nothing(&cfg, op, t);
            assert_eq!(skip, rec.weights.is_empty(), "{} at T = {t}", op.id);
            if skip {
                seen.0 = true;
            } else {
                seen.1 = true;
            }
        }
    }
    assert_eq!(seen, (true, true), "both cases occur");
}

/// Every op the loader stages weights for reads weights in the run (the embedding, read a
/// few rows at a time, is not staged: 1 GB of a Flash checkpoint).
#[test]
fn the_plan_stages_only_weights_the_ops_read() {
    // on disk: the loader stages stored file spans
    let dir = tempfile::tempdir().expect("temp dir");
    let so = nvfp4_probe::synth::SynthOptions::new(
        nvfp4_probe::synth::Preset::Tiny,
        nvfp4_probe::synth::Format::OfficialMixed,
        nvfp4_probe::checkpoint::naming::Naming::Official,
        0,
    );
    nvfp4_probe::synth::synth_to_dir(&so, dir.path()).expect("synth");
    let ck = Checkpoint::open(dir.path()).expect("open");
    let cfg = ck.model_config().expect("config").clone();
    let last = cfg.num_hidden_layers - 1;
    let ops = build_graph(&cfg, last, false);
    let r = run(
        &ck,
        &RunOptions::new((0, last), synthetic_tokens(12, cfg.vocab_size, 5)),
    )
    .expect("run");
    let mut staged_ops = 0;
    for op in &ops {
        if reads_nothing(&cfg, op, 12) {
            let rec = r.records.iter().find(|x| x.id == op.id).expect("record");
            assert!(rec.weights.is_empty(), "{} is left out but reads", op.id);
            continue;
        }
        let groups = stage_groups(&ck, op);
        if groups.iter().all(|g| g.spans.is_empty()) {
            continue;
        }
        staged_ops += 1;
        let rec = r.records.iter().find(|x| x.id == op.id).expect("record");
        assert!(
            !rec.weights.is_empty(),
            "{} is staged but reads no weight",
            op.id
        );
    }
    assert!(staged_ops > 0);
    assert!(
        ops.iter().any(|o| compressor_reads_nothing(&cfg, o, 12)),
        "a compressor left out at T = 12"
    );
    let embed = ops
        .iter()
        .find(|o| o.kind == OpKind::Embed)
        .expect("embed op");
    assert!(stage_groups(&ck, embed).is_empty());
}
