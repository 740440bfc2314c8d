//! `compare --names vllm|sglang` on the families beyond DeepSeek-V4 (`trace::engine_names`):
//! dumps written the way each engine names and lays out its modules' outputs — fused projections
//! concatenated in the engine's order, per-head norms as the engine shapes them, layer tuples,
//! partial sums over tensor-parallel ranks — built from our own BF16 oracle on the tiny
//! transformers-made checkpoints in tests/data/hf-families. Each must map every op the engine
//! exposes and compare clean, leave only non-op outputs (router logits, fused gate/up) unmapped,
//! and a planted error in one part of a fused output must be found at that part's op alone.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::cli::{CompareArgs, TokenArgs};
use nvfp4_probe::commands::compare::{compare, CompareReport};
use nvfp4_probe::model::ModelConfig;
use nvfp4_probe::probe::{run, RunOptions};
use nvfp4_probe::trace::read::{write, WriteDtype};
use nvfp4_probe::Tensor;

#[derive(Clone, Copy, PartialEq)]
enum Engine {
    Vllm,
    Sglang,
}

impl Engine {
    fn arg(self) -> &'static str {
        match self {
            Engine::Vllm => "vllm",
            Engine::Sglang => "sglang",
        }
    }
}

fn data(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(family)
}

fn tokens(family: &str) -> Vec<u32> {
    serde_json::from_str(&std::fs::read_to_string(data(family).join("tokens.json")).unwrap())
        .unwrap()
}

/// The family's config and our BF16 oracle's output of every op.
struct Oracle {
    cfg: ModelConfig,
    ops: HashMap<String, Tensor>,
    tokens: Vec<u32>,
}

impl Oracle {
    fn new(family: &str) -> Oracle {
        let ckpt = Checkpoint::open(&data(family)).unwrap();
        let cfg = ckpt.model_config().unwrap().clone();
        let tokens = tokens(family);
        let res = run(
            &ckpt,
            &RunOptions {
                keep_outputs: true,
                ..RunOptions::new((0, cfg.num_hidden_layers - 1), tokens.clone())
            },
        )
        .unwrap();
        let ops = res.outputs["oracle_bf16"].iter().cloned().collect();
        Oracle { cfg, ops, tokens }
    }
    fn op(&self, id: &str) -> Tensor {
        self.ops
            .get(id)
            .unwrap_or_else(|| panic!("the oracle has no {id}"))
            .clone()
    }
    fn t(&self) -> usize {
        self.tokens.len()
    }
    /// The op ids the engine's modules expose: every op but those ending in `missing`.
    fn expected(&self, missing: &[&str]) -> BTreeSet<String> {
        self.ops
            .keys()
            .filter(|id| !missing.iter().any(|m| id.ends_with(m)))
            .cloned()
            .collect()
    }
}

/// [T, a] ++ [T, b] ++ … along the columns.
fn cat(parts: &[Tensor]) -> Tensor {
    let t = parts[0].rows();
    let w: usize = parts.iter().map(Tensor::cols).sum();
    let mut d = Vec::with_capacity(t * w);
    for i in 0..t {
        for p in parts {
            let c = p.cols();
            d.extend_from_slice(&p.data[i * c..(i + 1) * c]);
        }
    }
    Tensor::new(vec![t, w], d)
}

/// Columns `start..start+len` of a [T, W] tensor.
fn cols(t: &Tensor, start: usize, len: usize) -> Tensor {
    let w = t.cols();
    let d: Vec<f32> = (0..t.rows())
        .flat_map(|i| t.data[i * w + start..i * w + start + len].iter().copied())
        .collect();
    Tensor::new(vec![t.rows(), len], d)
}

/// The same values under another shape (heads as rows or as a dim of their own).
fn reshape(t: &Tensor, shape: Vec<usize>) -> Tensor {
    Tensor::new(shape, t.data.to_vec())
}

/// A stand-in for an output no op has (router logits, the fused gate/up): any finite values.
fn filler(rows: usize, w: usize) -> Tensor {
    Tensor::new(
        vec![rows, w],
        (0..rows * w)
            .map(|i| (i % 7) as f32 - 3.0)
            .collect::<Vec<f32>>(),
    )
}

/// Dump entries the capture script writes for a module returning a tuple: `PATH` (element 0),
/// then `PATH:i`.
fn tuple(v: &mut Vec<(String, Tensor)>, name: &str, elems: &[Tensor]) {
    v.push((name.to_string(), elems[0].clone()));
    for (i, e) in elems.iter().enumerate() {
        v.push((format!("{name}:{i}"), e.clone()));
    }
}

/// A linear layer's `(output, None)`: `PATH` and `PATH:0`.
fn linear(v: &mut Vec<(String, Tensor)>, name: &str, t: Tensor) {
    tuple(v, name, &[t]);
}

/// Which vLLM generation wrote the DeepSeek-V3 experts' output.
#[derive(Clone, Copy, PartialEq)]
enum VllmMoe {
    /// `MoERunner`: shared + scaled routed, one tensor.
    Runner,
    /// `SharedFusedMoE`: the tuple (shared, routed before the scaling factor).
    Tuple,
}

/// Options of a DeepSeek-V3 dump.
#[derive(Clone, Copy)]
struct V3 {
    moe: VllmMoe,
    /// SGLang with the shared expert fused into the routed experts (no module of its own).
    fused_shared: bool,
}

/// The layer-level entries every engine writes: the fused add-RMSNorms' `(normed, residual)`,
/// the layer's `(mlp output, residual)`, the final norm's tuple.
fn layer_frame(o: &Oracle, n: usize, ffn: &str, v: &mut Vec<(String, Tensor)>) {
    let p = format!("model.layers.{n}");
    let s = |x: &str| o.op(&format!("L{n}.{x}"));
    if n == 0 {
        v.push((format!("{p}.input_layernorm"), s("attn.norm")));
    } else {
        let prev = o.op(&format!("L{}.out", n - 1));
        tuple(v, &format!("{p}.input_layernorm"), &[s("attn.norm"), prev]);
    }
    tuple(
        v,
        &format!("{p}.post_attention_layernorm"),
        &[s("ffn.norm"), s("attn.res")],
    );
    tuple(v, &p, &[s(ffn), s("attn.res")]);
}

fn head_frame(o: &Oracle, embed: &str, v: &mut Vec<(String, Tensor)>) {
    let last = o.cfg.num_hidden_layers - 1;
    v.insert(0, (embed.to_string(), o.op("embed")));
    tuple(
        v,
        "model.norm",
        &[o.op("final_norm"), o.op(&format!("L{last}.out"))],
    );
    v.push(("logits".into(), o.op("head")));
}

/// DeepSeek-V3 as vLLM (`deepseek_v2.py`, `mla.py`) or SGLang (`deepseek_v2.py`) names it.
fn deepseek_v3(o: &Oracle, e: Engine, opt: V3) -> Vec<(String, Tensor)> {
    let fam = o.cfg.family.as_ref().unwrap();
    let t = o.t();
    let mut v = Vec::new();
    for n in 0..o.cfg.num_hidden_layers {
        let p = format!("model.layers.{n}");
        let s = |x: &str| o.op(&format!("L{n}.{x}"));
        let a = format!("{p}.self_attn");
        let fused = match e {
            Engine::Vllm => "fused_qkv_a_proj",
            Engine::Sglang => "fused_qkv_a_proj_with_mqa",
        };
        linear(
            &mut v,
            &format!("{a}.{fused}"),
            cat(&[s("attn.q_a"), s("attn.kv_a")]),
        );
        v.push((format!("{a}.q_a_layernorm"), s("attn.q_norm")));
        linear(&mut v, &format!("{a}.q_b_proj"), s("attn.q_b"));
        v.push((format!("{a}.kv_a_layernorm"), s("attn.kv_norm")));
        linear(&mut v, &format!("{a}.kv_b_proj"), s("attn.kv_b"));
        v.push((format!("{a}.o_proj:input"), s("attn.core")));
        linear(&mut v, &format!("{a}.o_proj"), s("attn.o"));
        v.push((a.clone(), s("attn.o")));
        match e {
            Engine::Vllm => {
                v.push((format!("{a}.mla_attn"), s("attn.o")));
                v.push((format!("{a}.mla_attn.mla_attn"), s("attn.core")));
            }
            Engine::Sglang => v.push((format!("{a}.attn_mha"), s("attn.core"))),
        }
        let dense = fam.dense[n];
        let m = format!("{p}.mlp");
        if dense {
            linear(
                &mut v,
                &format!("{m}.gate_up_proj"),
                filler(t, 2 * fam.intermediate_size),
            );
            v.push((m.clone(), s("ffn.mlp")));
        } else {
            let logits = filler(t, o.cfg.n_routed_experts);
            match e {
                Engine::Vllm => {
                    linear(&mut v, &format!("{m}.gate"), logits);
                    v.push((format!("{m}.shared_experts"), s("ffn.shared")));
                    match opt.moe {
                        VllmMoe::Runner => v.push((format!("{m}.experts"), s("ffn.out"))),
                        VllmMoe::Tuple => {
                            let f = o.cfg.routed_scaling_factor as f32;
                            let mut routed = s("ffn.experts");
                            routed.data.iter_mut().for_each(|x| *x /= f);
                            tuple(&mut v, &format!("{m}.experts"), &[s("ffn.shared"), routed]);
                        }
                    }
                }
                Engine::Sglang => {
                    v.push((format!("{m}.gate"), logits.clone()));
                    tuple(
                        &mut v,
                        &format!("{m}.topk"),
                        &[s("ffn.router"), s("ffn.router.idx"), logits],
                    );
                    if opt.fused_shared {
                        v.push((format!("{m}.experts"), s("ffn.out")));
                    } else {
                        v.push((format!("{m}.experts"), s("ffn.experts")));
                        v.push((format!("{m}.shared_experts"), s("ffn.shared")));
                    }
                }
            }
            v.push((m.clone(), s("ffn.out")));
        }
        layer_frame(o, n, if dense { "ffn.mlp" } else { "ffn.out" }, &mut v);
    }
    head_frame(o, "model.embed_tokens", &mut v);
    v
}

/// Qwen3-MoE or gpt-oss as vLLM (`qwen3_moe.py`, `gpt_oss.py`) or SGLang names it; `ranks`
/// tensor-parallel files (column-parallel outputs split by heads, row-parallel ones and the
/// experts as partial sums).
fn gqa(o: &Oracle, e: Engine, ranks: usize) -> Vec<Vec<(String, Tensor)>> {
    let fam = o.cfg.family.as_ref().unwrap();
    let qwen = fam.kind == nvfp4_probe::model::family::Kind::Qwen3Moe;
    let (t, h, kv, dh) = (
        o.t(),
        o.cfg.num_attention_heads,
        fam.num_key_value_heads,
        o.cfg.head_dim,
    );
    // fewer KV heads than ranks: each rank holds a copy of one (vLLM's and SGLang's
    // `num_kv_heads = max(1, total // tp)`)
    let (hl, kvl) = (h / ranks, (kv / ranks).max(1));
    // rank r's heads of a head-major [T, heads·w] output
    let heads_of = |x: &Tensor, r: usize| {
        let w = x.cols() / ranks;
        cols(x, r * w, w)
    };
    let kv_of = |x: &Tensor, r: usize| {
        if kv >= ranks {
            heads_of(x, r)
        } else {
            cols(x, r * kv / ranks * dh, dh)
        }
    };
    // partial sums over the ranks whose total is the value
    let part = |x: &Tensor, r: usize| {
        if ranks == 1 {
            return x.clone();
        }
        let a: Vec<f32> = x.data.iter().map(|v| (v * 0.25).round()).collect();
        let d: Vec<f32> = match r {
            0 => a,
            1 => x.data.iter().zip(&a).map(|(v, a)| v - a).collect(),
            _ => vec![0.0; a.len()],
        };
        Tensor::new(x.shape.clone(), d)
    };
    let mut files = vec![Vec::new(); ranks];
    for (r, v) in files.iter_mut().enumerate() {
        for n in 0..o.cfg.num_hidden_layers {
            let p = format!("model.layers.{n}");
            let s = |x: &str| o.op(&format!("L{n}.{x}"));
            let a = if e == Engine::Vllm && !qwen {
                format!("{p}.attn")
            } else {
                format!("{p}.self_attn")
            };
            let qkv = cat(&[
                heads_of(&s("attn.q"), r),
                kv_of(&s("attn.k"), r),
                kv_of(&s("attn.v"), r),
            ]);
            linear(v, &format!("{a}.qkv_proj"), qkv);
            if qwen {
                let (q, k) = (heads_of(&s("attn.q_norm"), r), kv_of(&s("attn.k_norm"), r));
                let (q, k) = match e {
                    // vLLM norms `[T, heads, head_dim]`, SGLang `[T · heads, head_dim]`
                    Engine::Vllm => (reshape(&q, vec![t, hl, dh]), reshape(&k, vec![t, kvl, dh])),
                    Engine::Sglang => (
                        reshape(&q, vec![t * hl, dh]),
                        reshape(&k, vec![t * kvl, dh]),
                    ),
                };
                v.push((format!("{a}.q_norm"), q));
                v.push((format!("{a}.k_norm"), k));
            }
            v.push((format!("{a}.attn"), heads_of(&s("attn.core"), r)));
            v.push((format!("{a}.o_proj:input"), heads_of(&s("attn.core"), r)));
            linear(v, &format!("{a}.o_proj"), part(&s("attn.o"), r));
            let m = format!("{p}.mlp");
            let logits = filler(t, o.cfg.n_routed_experts);
            let router = if qwen { "gate" } else { "router" };
            linear(v, &format!("{m}.{router}"), logits.clone());
            let mut experts = part(&s("ffn.experts"), r);
            if e == Engine::Vllm && !qwen {
                // gpt-oss's experts may write a padded hidden dim; vLLM cuts it after
                experts = cat(&[experts, filler(t, 16)]);
            }
            if e == Engine::Sglang {
                tuple(
                    v,
                    &format!("{m}.topk"),
                    &[s("ffn.router"), s("ffn.router.idx"), logits],
                );
            }
            v.push((format!("{m}.experts"), experts));
            v.push((m, part(&s("ffn.experts"), r)));
            layer_frame(o, n, "ffn.experts", v);
        }
        let embed = if e == Engine::Vllm && !qwen {
            "model.embedding"
        } else {
            "model.embed_tokens"
        };
        head_frame(o, embed, v);
    }
    files
}

fn args(model: &Path, trace: &Path, names: &str) -> CompareArgs {
    CompareArgs {
        model: Some(model.to_path_buf()),
        trace: trace.to_path_buf(),
        names: names.into(),
        tokens: TokenArgs::default(),
        json: None,
        markdown: None,
        seed: 0,
        mem: Default::default(),
    }
}

/// Writes the dump (one file, or one per rank) and compares it under the engine's names.
fn compare_dump(
    family: &str,
    o: &Oracle,
    e: Engine,
    files: &[Vec<(String, Tensor)>],
    dtype: WriteDtype,
) -> CompareReport {
    let dir = tempfile::tempdir().unwrap();
    let path = if files.len() == 1 {
        let p = dir.path().join("dump.safetensors");
        write(&p, &files[0], dtype, Some(&o.tokens), &[]).unwrap();
        p
    } else {
        for (r, f) in files.iter().enumerate() {
            let p = dir.path().join(format!("rank{r}.safetensors"));
            write(&p, f, dtype, Some(&o.tokens), &[]).unwrap();
        }
        dir.path().to_path_buf()
    };
    compare(&args(&data(family), &path, e.arg())).expect("compare")
}

fn compared(r: &CompareReport) -> BTreeSet<String> {
    r.ops.iter().map(|o| o.op.clone()).collect()
}

/// Clean, every expected op compared (and no other), nothing skipped, and exactly the names
/// whose suffix is in `unmapped` left unmapped.
fn assert_clean(r: &CompareReport, want: &BTreeSet<String>, unmapped: &[&str], what: &str) {
    let bad: Vec<String> = r
        .ops
        .iter()
        .filter(|o| o.diverges())
        .map(|o| format!("{} ({}): {} {:?}", o.op, o.trace_name, o.verdict, o.reason))
        .collect();
    assert!(bad.is_empty(), "{what}: divergent {bad:?}");
    assert_eq!(r.summary.first_divergent, None, "{what}");
    assert!(
        r.summary.skipped.is_empty(),
        "{what}: skipped {:?}",
        r.summary.skipped
    );
    let got = compared(r);
    let missing: Vec<&String> = want.difference(&got).collect();
    let extra: Vec<&String> = got.difference(want).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "{what}: not compared {missing:?}, unexpected {extra:?}"
    );
    for n in &r.summary.unmapped {
        assert!(
            unmapped.iter().any(|u| n.ends_with(u)),
            "{what}: {n} unmapped"
        );
    }
    for u in unmapped {
        assert!(
            r.summary.unmapped.iter().any(|n| n.ends_with(u)),
            "{what}: no unmapped name ends in {u}: {:?}",
            r.summary.unmapped
        );
    }
}

/// Doubles columns `start..start+len` of every row of `name`'s tensor (rel-L2 1 there: far
/// beyond the tolerance, which at layer 2 of this random model is some 0.3).
fn plant(files: &mut [Vec<(String, Tensor)>], name: &str, start: usize, len: usize) {
    for f in files.iter_mut() {
        for (n, t) in f.iter_mut() {
            if n == name || n.strip_suffix(":0") == Some(name) {
                let w = t.cols();
                for i in 0..t.rows() {
                    t.data[i * w + start..i * w + start + len]
                        .iter_mut()
                        .for_each(|x| *x *= 2.0);
                }
            }
        }
    }
}

/// Only `op` diverges, and its sibling in the fused output is compared exactly.
fn assert_only(r: &CompareReport, op: &str, sibling: &str) {
    let at: Vec<(f64, Option<f64>)> = r
        .ops
        .iter()
        .filter(|c| c.op == op)
        .map(|c| (c.tolerance, c.vs_bf16.rel_l2))
        .collect();
    assert_eq!(
        r.summary.first_divergent.as_deref(),
        Some(op),
        "{:?}; at {op} (tolerance, rel-L2): {at:?}",
        r.summary
    );
    assert_eq!(r.summary.divergent, 1, "{:?}", r.summary);
    let sib = r
        .ops
        .iter()
        .find(|o| o.op == sibling)
        .expect("sibling compared");
    assert!(!sib.diverges());
    assert_eq!(
        sib.vs_bf16.rel_l2,
        Some(0.0),
        "{sibling}: {:?}",
        sib.vs_bf16
    );
}

const ROPE: [&str; 2] = [".attn.q_rope", ".attn.k_rope"];

#[test]
fn deepseek_v3_vllm_both_moe_generations_map_every_op_and_compare_clean() {
    let o = Oracle::new("deepseek_v3");
    let unmapped = [".mlp.gate", ".mlp.gate_up_proj"];
    // MoERunner: the routed sum alone is not exposed, nor the router
    let d = deepseek_v3(
        &o,
        Engine::Vllm,
        V3 {
            moe: VllmMoe::Runner,
            fused_shared: false,
        },
    );
    let r = compare_dump("deepseek_v3", &o, Engine::Vllm, &[d], WriteDtype::Bf16);
    let mut miss = ROPE.to_vec();
    miss.extend([".ffn.router", ".ffn.router.idx", ".ffn.experts"]);
    assert_clean(&r, &o.expected(&miss), &unmapped, "vllm runner");
    // one name per op where the dump wrote PATH and PATH:0
    assert!(r.ops.iter().all(|c| !c.trace_name.ends_with(":0")));
    // the fused q_a/kv_a parts are exactly the oracle's
    for op in ["L1.attn.q_a", "L2.attn.kv_a"] {
        let c = r.ops.iter().find(|c| c.op == op).unwrap();
        assert_eq!(c.vs_bf16.rel_l2, Some(0.0), "{op}");
    }
    // SharedFusedMoE: (shared, routed before the factor) — the routed sum is compared, scaled
    let d = deepseek_v3(
        &o,
        Engine::Vllm,
        V3 {
            moe: VllmMoe::Tuple,
            fused_shared: false,
        },
    );
    let r = compare_dump("deepseek_v3", &o, Engine::Vllm, &[d], WriteDtype::Bf16);
    let mut miss = ROPE.to_vec();
    miss.extend([".ffn.router", ".ffn.router.idx"]);
    assert_clean(&r, &o.expected(&miss), &unmapped, "vllm tuple");
    let ex = r.ops.iter().find(|c| c.op == "L2.ffn.experts").unwrap();
    assert_eq!(ex.trace_name, "model.layers.2.mlp.experts:1");
    // the factor was multiplied back: one BF16 rounding of the divided values, no more
    assert!(ex.vs_bf16.rel_l2.unwrap() < 4e-3, "{:?}", ex.vs_bf16);
}

#[test]
fn deepseek_v3_sglang_maps_every_op_with_and_without_a_fused_shared_expert() {
    let o = Oracle::new("deepseek_v3");
    // routed_scaling_factor 2.5: SGLang's top-k weights are left out, its ids compared
    // (`PATH:0` beside `PATH` is passed over, mapped or not)
    let unmapped = [".mlp.gate", ".mlp.gate_up_proj", ".mlp.topk", ".mlp.topk:2"];
    let d = deepseek_v3(
        &o,
        Engine::Sglang,
        V3 {
            moe: VllmMoe::Runner,
            fused_shared: false,
        },
    );
    let r = compare_dump("deepseek_v3", &o, Engine::Sglang, &[d], WriteDtype::Bf16);
    let mut miss = ROPE.to_vec();
    miss.push(".ffn.router");
    assert_clean(&r, &o.expected(&miss), &unmapped, "sglang");
    // the shared expert fused into the experts: their output is routed + shared
    let d = deepseek_v3(
        &o,
        Engine::Sglang,
        V3 {
            moe: VllmMoe::Runner,
            fused_shared: true,
        },
    );
    let r = compare_dump("deepseek_v3", &o, Engine::Sglang, &[d], WriteDtype::Bf16);
    miss.extend([".ffn.shared", ".ffn.experts"]);
    assert_clean(&r, &o.expected(&miss), &unmapped, "sglang fused shared");
    let out = r
        .ops
        .iter()
        .filter(|c| c.op == "L1.ffn.out")
        .map(|c| c.trace_name.as_str())
        .collect::<BTreeSet<_>>();
    assert!(out.contains("model.layers.1.mlp.experts"), "{out:?}");
}

#[test]
fn deepseek_v3_planted_error_in_the_kv_part_of_fused_qkv_a_is_found_at_kv_a() {
    let o = Oracle::new("deepseek_v3");
    let fam = o.cfg.family.as_ref().unwrap();
    let q = fam.q_lora_rank.unwrap();
    let kv = fam.kv_lora_rank + o.cfg.qk_rope_head_dim;
    for (e, fused) in [
        (Engine::Vllm, "fused_qkv_a_proj"),
        (Engine::Sglang, "fused_qkv_a_proj_with_mqa"),
    ] {
        let mut files = vec![deepseek_v3(
            &o,
            e,
            V3 {
                moe: VllmMoe::Runner,
                fused_shared: false,
            },
        )];
        plant(
            &mut files,
            &format!("model.layers.1.self_attn.{fused}"),
            q,
            kv,
        );
        let r = compare_dump("deepseek_v3", &o, e, &files, WriteDtype::Bf16);
        assert_only(&r, "L1.attn.kv_a", "L1.attn.q_a");
        // and the query part: found at q_a, kv_a exact
        let mut files = vec![deepseek_v3(
            &o,
            e,
            V3 {
                moe: VllmMoe::Runner,
                fused_shared: false,
            },
        )];
        plant(
            &mut files,
            &format!("model.layers.2.self_attn.{fused}"),
            0,
            q,
        );
        let r = compare_dump("deepseek_v3", &o, e, &files, WriteDtype::Bf16);
        assert_only(&r, "L2.attn.q_a", "L2.attn.kv_a");
    }
}

#[test]
fn deepseek_v3_tensor_parallel_heads_join() {
    let o = Oracle::new("deepseek_v3");
    let d = deepseek_v3(
        &o,
        Engine::Vllm,
        V3 {
            moe: VllmMoe::Runner,
            fused_shared: false,
        },
    );
    // two ranks: q_b, kv_b and the core split by heads, o_proj and the shared expert as partial
    // sums, the rest replicated
    let mut files = vec![Vec::new(), Vec::new()];
    for (name, t) in d {
        let by_heads = ["q_b_proj", "kv_b_proj", "o_proj:input", "mla_attn.mla_attn"]
            .iter()
            .any(|s| name.ends_with(s) || name.strip_suffix(":0").is_some_and(|n| n.ends_with(s)));
        let partial = name.ends_with("self_attn.o_proj") || name.ends_with("mlp.shared_experts");
        for (r, f) in files.iter_mut().enumerate() {
            let piece = if by_heads {
                let w = t.cols() / 2;
                cols(&t, r * w, w)
            } else if partial {
                let a: Vec<f32> = t.data.iter().map(|v| (v * 0.25).round()).collect();
                let d = if r == 0 {
                    a
                } else {
                    t.data.iter().zip(&a).map(|(v, a)| v - a).collect()
                };
                Tensor::new(t.shape.clone(), d)
            } else {
                t.clone()
            };
            f.push((name.clone(), piece));
        }
    }
    let r = compare_dump("deepseek_v3", &o, Engine::Vllm, &files, WriteDtype::F32);
    assert_eq!(r.trace.ranks, 2);
    let mut miss = ROPE.to_vec();
    miss.extend([".ffn.router", ".ffn.router.idx", ".ffn.experts"]);
    assert_clean(
        &r,
        &o.expected(&miss),
        &[".mlp.gate", ".mlp.gate_up_proj"],
        "vllm tp2",
    );
    for op in [
        "L1.attn.q_b",
        "L1.attn.kv_b",
        "L1.attn.core",
        "L1.attn.o",
        "L1.ffn.shared",
    ] {
        let c = r.ops.iter().find(|c| c.op == op).unwrap();
        assert_eq!(c.vs_bf16.rel_l2, Some(0.0), "{op}");
    }
}

#[test]
fn qwen3_moe_both_engines_map_every_op_single_and_two_ranks() {
    let o = Oracle::new("qwen3_moe");
    for e in [Engine::Vllm, Engine::Sglang] {
        for ranks in [1, 2] {
            let files = gqa(&o, e, ranks);
            let dtype = if ranks == 1 {
                WriteDtype::Bf16
            } else {
                WriteDtype::F32
            };
            let r = compare_dump("qwen3_moe", &o, e, &files, dtype);
            let mut miss = ROPE.to_vec();
            // vLLM's router runs inside its experts module: no output of its own
            if e == Engine::Vllm {
                miss.extend([".ffn.router", ".ffn.router.idx"]);
            }
            let unmapped: &[&str] = match e {
                Engine::Vllm => &[".mlp.gate"],
                Engine::Sglang => &[".mlp.gate", ".mlp.topk:2"],
            };
            let what = format!("{} tp{ranks}", e.arg());
            assert_clean(&r, &o.expected(&miss), unmapped, &what);
            for op in [
                "L1.attn.q",
                "L1.attn.k",
                "L1.attn.v",
                "L2.attn.q_norm",
                "L2.attn.k_norm",
            ] {
                let c = r.ops.iter().find(|c| c.op == op).unwrap();
                assert_eq!(c.vs_bf16.rel_l2, Some(0.0), "{what}: {op}");
            }
        }
    }
}

/// Four ranks over two KV heads: each rank holds a copy of one, which the join refuses (the
/// tensors are listed as skipped, with why) rather than misreading; the query side still joins.
#[test]
fn qwen3_moe_replicated_kv_heads_are_skipped_not_misjoined() {
    let o = Oracle::new("qwen3_moe");
    for e in [Engine::Vllm, Engine::Sglang] {
        let r = compare_dump("qwen3_moe", &o, e, &gqa(&o, e, 4), WriteDtype::F32);
        assert_eq!(r.trace.ranks, 4);
        assert_eq!(r.summary.first_divergent, None, "{:?}", r.summary);
        let skipped: BTreeSet<&str> = r.summary.skipped.iter().map(|s| s.op.as_str()).collect();
        let want: BTreeSet<String> = (0..o.cfg.num_hidden_layers)
            .flat_map(|n| ["attn.k", "attn.v", "attn.k_norm"].map(|x| format!("L{n}.{x}")))
            .collect();
        assert_eq!(
            skipped,
            want.iter().map(String::as_str).collect::<BTreeSet<_>>()
        );
        assert!(r
            .summary
            .skipped
            .iter()
            .all(|s| s.reason.contains("2 heads do not divide over 4 ranks")));
        for op in ["L1.attn.q", "L1.attn.q_norm", "L1.attn.core"] {
            let c = r.ops.iter().find(|c| c.op == op).unwrap();
            assert_eq!(c.vs_bf16.rel_l2, Some(0.0), "{op}");
        }
    }
}

#[test]
fn qwen3_moe_planted_error_in_the_v_part_of_qkv_proj_is_found_at_v() {
    let o = Oracle::new("qwen3_moe");
    let fam = o.cfg.family.as_ref().unwrap();
    let (q, kv) = (
        o.cfg.num_attention_heads * o.cfg.head_dim,
        fam.num_key_value_heads * o.cfg.head_dim,
    );
    for e in [Engine::Vllm, Engine::Sglang] {
        let mut files = gqa(&o, e, 1);
        plant(&mut files, "model.layers.1.self_attn.qkv_proj", q + kv, kv);
        let r = compare_dump("qwen3_moe", &o, e, &files, WriteDtype::Bf16);
        assert_only(&r, "L1.attn.v", "L1.attn.k");
        // over two ranks the v part of rank 1 only: still v, and k exact
        let mut files = gqa(&o, e, 2);
        let (ql, kvl) = (q / 2, kv / 2);
        let name = "model.layers.1.self_attn.qkv_proj";
        for (n, t) in files[1].iter_mut() {
            if n == name || n.strip_suffix(":0") == Some(name) {
                let w = t.cols();
                for i in 0..t.rows() {
                    t.data[i * w + ql + kvl..i * w + w]
                        .iter_mut()
                        .for_each(|x| *x *= 2.0);
                }
            }
        }
        let r = compare_dump("qwen3_moe", &o, e, &files, WriteDtype::F32);
        assert_only(&r, "L1.attn.v", "L1.attn.k");
    }
}

#[test]
fn gpt_oss_both_engines_map_every_op_and_a_planted_k_error_is_found_at_k() {
    let o = Oracle::new("gpt_oss");
    let (q, kv) = (
        o.cfg.num_attention_heads * o.cfg.head_dim,
        o.cfg.family.as_ref().unwrap().num_key_value_heads * o.cfg.head_dim,
    );
    for e in [Engine::Vllm, Engine::Sglang] {
        let r = compare_dump("gpt_oss", &o, e, &gqa(&o, e, 1), WriteDtype::Bf16);
        let mut miss = ROPE.to_vec();
        if e == Engine::Vllm {
            miss.extend([".ffn.router", ".ffn.router.idx"]);
        }
        let unmapped: &[&str] = match e {
            Engine::Vllm => &[".mlp.router"],
            Engine::Sglang => &[".mlp.router", ".mlp.topk:2"],
        };
        assert_clean(&r, &o.expected(&miss), unmapped, e.arg());
        // vLLM's padded experts output cut to hidden (else its width would not make rows): within
        // the BF16 rounding of the dump (the oracle keeps this op's output unrounded)
        let c = r
            .ops
            .iter()
            .find(|c| c.trace_name == "model.layers.1.mlp.experts")
            .unwrap();
        assert_eq!(c.op, "L1.ffn.experts");
        assert!(c.vs_bf16.rel_l2.unwrap() < 4e-3, "{:?}", c.vs_bf16);
        let attn = if e == Engine::Vllm {
            "attn"
        } else {
            "self_attn"
        };
        let mut files = gqa(&o, e, 1);
        plant(
            &mut files,
            &format!("model.layers.0.{attn}.qkv_proj"),
            q,
            kv,
        );
        let r = compare_dump("gpt_oss", &o, e, &files, WriteDtype::Bf16);
        assert_only(&r, "L0.attn.k", "L0.attn.q");
    }
}
