//! An in-memory [`OpEnv`] with f32 weights: random tiny models for tests and for exercising the
//! runner without a checkpoint. Linears are plain f32 matrices, so the env's numerics are exactly
//! "x @ Wᵀ in f32"; `bf16` switches `store` to BF16 rounding.

use std::collections::HashMap;

use super::exec::OpEnv;
use super::ModelConfig;
use crate::device::ops::{gemm, matmul_nt};
use crate::{Error, Result, Tensor};

/// splitmix64 + Box–Muller: deterministic, dependency-free test data.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in (0, 1).
    pub fn uniform(&mut self) -> f64 {
        ((self.next_u64() >> 11) as f64 + 0.5) / (1u64 << 53) as f64
    }
    pub fn normal(&mut self) -> f64 {
        let (u1, u2) = (self.uniform(), self.uniform());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
    pub fn normals(&mut self, n: usize, mean: f64, std: f64) -> Vec<f32> {
        (0..n)
            .map(|_| (mean + std * self.normal()) as f32)
            .collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

pub struct MemEnv {
    pub cfg: ModelConfig,
    pub tokens: Vec<u32>,
    /// Non-linear parameters and `embed.weight`, by canonical name.
    pub params: HashMap<String, Tensor>,
    /// Linear weights [out, in] by base name (`layers.0.attn.wq_a`, `head`, …).
    pub linears: HashMap<String, Tensor>,
    /// Round stored activations to BF16 (the BF16 path) instead of keeping f32.
    pub bf16: bool,
    /// Every `linear`/`linear_grouped` call as (sub_id, base), in call order.
    pub calls: Vec<(String, String)>,
}

impl MemEnv {
    /// A random model for `cfg` (all layers). Linears ~ N(0, 1/in), rounded to BF16 so the same
    /// weights are exact on every path; hc fn ~ N(0, 0.02); norm weights ≈ 1; random sinks, ape,
    /// gate bias; tid2eid rows of distinct experts.
    pub fn random(cfg: &ModelConfig, tokens: Vec<u32>, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let mut params = HashMap::new();
        let mut linears = HashMap::new();
        let (d, hc, mix) = (cfg.hidden_size, cfg.hc_mult, cfg.hc_mix());
        fn lin(
            m: &mut HashMap<String, Tensor>,
            rng: &mut Rng,
            name: String,
            out: usize,
            inp: usize,
        ) {
            let mut w = Tensor::new(
                vec![out, inp],
                rng.normals(out * inp, 0.0, (1.0 / inp as f64).sqrt()),
            );
            w.round_bf16();
            m.insert(name, w);
        }
        fn par(
            m: &mut HashMap<String, Tensor>,
            rng: &mut Rng,
            name: String,
            shape: Vec<usize>,
            mean: f64,
            std: f64,
        ) {
            let n = shape.iter().product();
            m.insert(name, Tensor::new(shape, rng.normals(n, mean, std)));
        }
        par(
            &mut params,
            &mut rng,
            "embed.weight".into(),
            vec![cfg.vocab_size, d],
            0.0,
            1.0,
        );
        if let Some(e) = params.get_mut("embed.weight") {
            e.round_bf16();
        }
        let (h, dh, lq) = (cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank);
        let (g, ro) = (cfg.o_groups, cfg.o_lora_rank);
        let (e, k, inter) = (
            cfg.n_routed_experts,
            cfg.num_experts_per_tok,
            cfg.moe_intermediate_size,
        );
        let (hi, di) = (cfg.index_n_heads, cfg.index_head_dim);
        for n in 0..cfg.num_hidden_layers.min(cfg.compress_ratios.len()) {
            let p = |s: &str| format!("layers.{n}.{s}");
            for side in ["attn", "ffn"] {
                par(
                    &mut params,
                    &mut rng,
                    p(&format!("hc_{side}_fn")),
                    vec![mix, hc * d],
                    0.0,
                    0.02,
                );
                par(
                    &mut params,
                    &mut rng,
                    p(&format!("hc_{side}_base")),
                    vec![mix],
                    0.0,
                    0.1,
                );
                par(
                    &mut params,
                    &mut rng,
                    p(&format!("hc_{side}_scale")),
                    vec![3],
                    1.0,
                    0.1,
                );
            }
            par(
                &mut params,
                &mut rng,
                p("attn_norm.weight"),
                vec![d],
                1.0,
                0.1,
            );
            par(
                &mut params,
                &mut rng,
                p("ffn_norm.weight"),
                vec![d],
                1.0,
                0.1,
            );
            lin(&mut linears, &mut rng, p("attn.wq_a"), lq, d);
            lin(&mut linears, &mut rng, p("attn.wkv"), dh, d);
            par(
                &mut params,
                &mut rng,
                p("attn.q_norm.weight"),
                vec![lq],
                1.0,
                0.1,
            );
            par(
                &mut params,
                &mut rng,
                p("attn.kv_norm.weight"),
                vec![dh],
                1.0,
                0.1,
            );
            lin(&mut linears, &mut rng, p("attn.wq_b"), h * dh, lq);
            lin(&mut linears, &mut rng, p("attn.wo_a"), g * ro, h * dh / g);
            lin(&mut linears, &mut rng, p("attn.wo_b"), d, g * ro);
            par(
                &mut params,
                &mut rng,
                p("attn.attn_sink"),
                vec![h],
                0.0,
                0.5,
            );
            let r = cfg.ratio(n);
            if r > 0 {
                let c = if r == 4 { 2 } else { 1 };
                lin(&mut linears, &mut rng, p("attn.compressor.wkv"), c * dh, d);
                lin(
                    &mut linears,
                    &mut rng,
                    p("attn.compressor.wgate"),
                    c * dh,
                    d,
                );
                par(
                    &mut params,
                    &mut rng,
                    p("attn.compressor.ape"),
                    vec![r, c * dh],
                    0.0,
                    0.1,
                );
                par(
                    &mut params,
                    &mut rng,
                    p("attn.compressor.norm.weight"),
                    vec![dh],
                    1.0,
                    0.1,
                );
            }
            if r == 4 {
                lin(&mut linears, &mut rng, p("attn.indexer.wq_b"), hi * di, lq);
                lin(
                    &mut linears,
                    &mut rng,
                    p("attn.indexer.weights_proj"),
                    hi,
                    d,
                );
                lin(
                    &mut linears,
                    &mut rng,
                    p("attn.indexer.compressor.wkv"),
                    2 * di,
                    d,
                );
                lin(
                    &mut linears,
                    &mut rng,
                    p("attn.indexer.compressor.wgate"),
                    2 * di,
                    d,
                );
                par(
                    &mut params,
                    &mut rng,
                    p("attn.indexer.compressor.ape"),
                    vec![4, 2 * di],
                    0.0,
                    0.1,
                );
                par(
                    &mut params,
                    &mut rng,
                    p("attn.indexer.compressor.norm.weight"),
                    vec![di],
                    1.0,
                    0.1,
                );
            }
            lin(&mut linears, &mut rng, p("ffn.gate"), e, d);
            if cfg.is_hash_layer(n) {
                let mut tab = Vec::with_capacity(cfg.vocab_size * k);
                for _ in 0..cfg.vocab_size {
                    let mut row: Vec<usize> = Vec::with_capacity(k);
                    while row.len() < k {
                        let x = rng.below(e);
                        if !row.contains(&x) {
                            row.push(x);
                        }
                    }
                    tab.extend(row.iter().map(|&x| x as f32));
                }
                params.insert(
                    p("ffn.gate.tid2eid"),
                    Tensor::new(vec![cfg.vocab_size, k], tab),
                );
            } else {
                par(&mut params, &mut rng, p("ffn.gate.bias"), vec![e], 0.0, 0.1);
            }
            for ex in 0..e {
                lin(
                    &mut linears,
                    &mut rng,
                    p(&format!("ffn.experts.{ex}.w1")),
                    inter,
                    d,
                );
                lin(
                    &mut linears,
                    &mut rng,
                    p(&format!("ffn.experts.{ex}.w3")),
                    inter,
                    d,
                );
                lin(
                    &mut linears,
                    &mut rng,
                    p(&format!("ffn.experts.{ex}.w2")),
                    d,
                    inter,
                );
            }
            let si = inter * cfg.n_shared_experts;
            lin(&mut linears, &mut rng, p("ffn.shared_experts.w1"), si, d);
            lin(&mut linears, &mut rng, p("ffn.shared_experts.w3"), si, d);
            lin(&mut linears, &mut rng, p("ffn.shared_experts.w2"), d, si);
        }
        par(
            &mut params,
            &mut rng,
            "hc_head_fn".into(),
            vec![hc, hc * d],
            0.0,
            0.02,
        );
        par(
            &mut params,
            &mut rng,
            "hc_head_base".into(),
            vec![hc],
            0.0,
            0.1,
        );
        par(
            &mut params,
            &mut rng,
            "hc_head_scale".into(),
            vec![1],
            1.0,
            0.1,
        );
        par(
            &mut params,
            &mut rng,
            "norm.weight".into(),
            vec![d],
            1.0,
            0.1,
        );
        lin(&mut linears, &mut rng, "head".into(), cfg.vocab_size, d);
        MemEnv {
            cfg: cfg.clone(),
            tokens,
            params,
            linears,
            bf16: false,
            calls: Vec::new(),
        }
    }

    fn missing(name: &str) -> Error {
        Error::MissingTensor {
            dir: "(memory)".into(),
            tensor: name.to_string(),
            hint: String::new(),
        }
    }

    fn weight(&self, base: &str) -> Result<&Tensor> {
        self.linears.get(base).ok_or_else(|| Self::missing(base))
    }
}

impl OpEnv for MemEnv {
    fn cfg(&self) -> &ModelConfig {
        &self.cfg
    }
    fn token_ids(&self) -> &[u32] {
        &self.tokens
    }
    fn param(&mut self, canonical: &str) -> Result<Tensor> {
        self.params
            .get(canonical)
            .cloned()
            .ok_or_else(|| Self::missing(canonical))
    }
    fn embed_rows(&mut self, ids: &[u32]) -> Result<Tensor> {
        let e = self
            .params
            .get("embed.weight")
            .ok_or_else(|| Self::missing("embed.weight"))?;
        let d = e.cols();
        let mut out = Vec::with_capacity(ids.len() * d);
        for &i in ids {
            if i as usize >= e.rows() {
                return Err(Error::bad(
                    "(memory)",
                    Some("embed.weight"),
                    format!("token id {i} ≥ vocab {}", e.rows()),
                ));
            }
            out.extend_from_slice(e.row(i as usize));
        }
        Ok(Tensor::new(vec![ids.len(), d], out))
    }
    fn linear(&mut self, sub_id: &str, x: &Tensor, base: &str) -> Result<Tensor> {
        self.calls.push((sub_id.to_string(), base.to_string()));
        let w = self.weight(base)?;
        if w.cols() != x.cols() {
            return Err(Error::bad(
                "(memory)",
                Some(base),
                format!("in {} ≠ activation width {}", w.cols(), x.cols()),
            ));
        }
        let y = matmul_nt(&x.data, x.rows(), x.cols(), &w.data, w.rows());
        Ok(Tensor::new(vec![x.rows(), w.rows()], y))
    }
    fn linear_grouped(
        &mut self,
        sub_id: &str,
        x: &Tensor,
        base: &str,
        groups: usize,
    ) -> Result<Tensor> {
        self.calls.push((sub_id.to_string(), base.to_string()));
        let w = self.weight(base)?;
        let kdim = x.cols();
        if groups == 0
            || w.rows() % groups != 0
            || w.cols() != kdim
            || x.shape.len() != 3
            || x.shape[1] != groups
        {
            return Err(Error::bad(
                "(memory)",
                Some(base),
                format!("shape {:?} vs activation {:?}", w.shape, x.shape),
            ));
        }
        let (rows, r) = (x.shape[0], w.rows() / groups);
        let mut y = vec![0.0f32; rows * groups * r];
        for g in 0..groups {
            gemm(
                rows,
                kdim,
                r,
                &x.data[g * kdim..],
                (groups * kdim, 1),
                &w.data[g * r * kdim..],
                (1, kdim),
                &mut y[g * r..],
                (groups * r, 1),
                false,
            );
        }
        Ok(Tensor::new(vec![rows, groups, r], y))
    }
    fn store(&self, t: &mut Tensor) {
        if self.bf16 {
            t.round_bf16();
        }
    }
}
