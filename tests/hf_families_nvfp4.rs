//! The families' NVFP4 checkpoints as the producers name them: the tiny transformers-made
//! checkpoints of tests/data/hf-families re-encoded to compressed-tensors NVFP4
//! (`<module>.weight_packed` / `weight_scale` / `weight_global_scale` / `input_global_scale`, as
//! llm-compressor writes them) and to ModelOpt NVFP4 (`weight` / `weight_scale` /
//! `weight_scale_2` / `input_scale` with hf_quant_config.json), each linear with the project's
//! producer-exact encoders. The reader must resolve every quantized module of the family to its
//! canonical weight, dequantize it to exactly the encoder's values, and `run` must go through.

use std::path::Path;

use nvfp4_probe::checkpoint::{Checkpoint, Dtype, ShardWriter};
use nvfp4_probe::numerics::nvfp4::{self, Convention};
use nvfp4_probe::probe::{run, RunOptions};
use safetensors::SafeTensors;

fn data(family: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(family)
}

fn bf16_to_f32(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(2)
        .map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16))
        .collect()
}

/// Which stored modules the producers quantize: the attention and expert projections (the
/// router gate, norms, embedding and head stay BF16, as llm-compressor's and ModelOpt's recipes
/// for these models leave them).
fn quantized(name: &str) -> bool {
    (name.ends_with("_proj.weight") || name.ends_with("_proj_with_mqa.weight"))
        && !name.contains(".mlp.gate.")
}

/// One encoded weight: raw module, packed nibbles, block scales, tensor scale, rows, cols.
type Encoded = (String, Vec<u8>, Vec<u8>, f32, usize, usize);

/// Re-encode `family`'s checkpoint into `dir`; returns (raw module, packed, scales, global) of
/// every quantized weight.
fn requantize(family: &str, ct: bool, dir: &Path) -> Vec<Encoded> {
    let src = data(family);
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut names: Vec<String> = st.names().into_iter().map(str::to_string).collect();
    names.sort();
    let mut w = ShardWriter::new(dir, 1 << 30).unwrap();
    let mut out = Vec::new();
    let mut modules = Vec::new();
    for name in &names {
        let t = st.tensor(name).unwrap();
        if !quantized(name) {
            w.add(name, t.dtype(), t.shape(), t.data().to_vec())
                .unwrap();
            continue;
        }
        assert_eq!(t.dtype(), safetensors::Dtype::BF16);
        let (o, i) = (t.shape()[0], t.shape()[1]);
        let v = bf16_to_f32(t.data());
        let q = if ct {
            nvfp4::quantize_ct(&v, o, i)
        } else {
            nvfp4::quantize_modelopt(&v, o, i)
        };
        let module = name.strip_suffix(".weight").unwrap().to_string();
        let act = 1.0f32; // a calibrated input scale; its value does not change the weight
        let (wl, gl, il, sshape): (&str, &str, &str, Vec<usize>) = if ct {
            (
                "weight_packed",
                "weight_global_scale",
                "input_global_scale",
                vec![1],
            )
        } else {
            ("weight", "weight_scale_2", "input_scale", vec![])
        };
        w.add(
            &format!("{module}.{wl}"),
            Dtype::U8,
            &[o, i / 2],
            q.packed.clone(),
        )
        .unwrap();
        w.add(
            &format!("{module}.weight_scale"),
            Dtype::F8_E4M3,
            &[o, i / 16],
            q.scales.clone(),
        )
        .unwrap();
        w.add(
            &format!("{module}.{gl}"),
            Dtype::F32,
            &sshape,
            q.global.to_le_bytes().to_vec(),
        )
        .unwrap();
        let a = if ct {
            nvfp4::global_scale_ct(act)
        } else {
            nvfp4::global_scale_modelopt(act)
        };
        w.add(
            &format!("{module}.{il}"),
            Dtype::F32,
            &sshape,
            a.to_le_bytes().to_vec(),
        )
        .unwrap();
        modules.push(module.clone());
        out.push((module, q.packed, q.scales, q.global, o, i));
    }
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    let ignore = serde_json::json!(["lm_head", "re:.*mlp.gate$"]);
    if ct {
        let args = |dynamic: serde_json::Value| {
            serde_json::json!({"num_bits": 4, "type": "float", "strategy": "tensor_group",
                "group_size": 16, "symmetric": true, "dynamic": dynamic})
        };
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "format": "nvfp4-pack-quantized",
                "weights": args(serde_json::json!(false)),
                "input_activations": args(serde_json::json!("local"))}},
            "ignore": ignore,
        });
    } else {
        cfg["quantization_config"] = serde_json::json!({
            "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
            "exclude_modules": ["lm_head", "*.mlp.gate"],
        });
        std::fs::write(
            dir.join("hf_quant_config.json"),
            serde_json::to_string(&serde_json::json!({
                "producer": {"name": "modelopt", "version": "0.47.0"},
                "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                    "exclude_modules": ["lm_head", "*.mlp.gate"]}
            }))
            .unwrap(),
        )
        .unwrap();
    }
    w.finish(&serde_json::to_string_pretty(&cfg).unwrap())
        .unwrap();
    std::fs::copy(src.join("tokens.json"), dir.join("tokens.json")).unwrap();
    out
}

/// Every quantized module resolves to a canonical NVFP4 weight that dequantizes exactly to the
/// encoder's values, and the whole model runs.
fn reads_and_runs(family: &str, ct: bool, min_weights: usize) {
    let dir = tempfile::tempdir().unwrap();
    let encoded = requantize(family, ct, dir.path());
    assert!(encoded.len() >= min_weights, "{} weights", encoded.len());
    let ckpt = Checkpoint::open(dir.path()).unwrap();
    let conv = if ct {
        Convention::CompressedTensors
    } else {
        Convention::ModelOpt
    };
    let bases = ckpt.weight_bases();
    for (module, packed, scales, g, o, i) in &encoded {
        let canon = ckpt
            .canonical_of(&format!("{module}.weight_scale"))
            .unwrap_or_else(|| panic!("{module}: no canonical name"))
            .strip_suffix(".weight_scale")
            .unwrap()
            .to_string();
        assert!(
            bases.contains(&canon),
            "{module} → {canon} is not a weight base"
        );
        let w = ckpt.weight(&canon).unwrap();
        assert_eq!(
            w.scheme(),
            if ct { "nvfp4-ct" } else { "nvfp4-modelopt" },
            "{module}"
        );
        let got = w.dequantize().unwrap();
        let want = nvfp4::dequantize(packed, scales, *g, conv, *o, *i);
        assert_eq!(got.shape, vec![*o, *i], "{module}");
        assert!(
            got.data
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{module}: dequantized values differ from the encoder's"
        );
    }
    // the op graph's linears are exactly the quantized modules plus the BF16 gate and head
    let cfg = ckpt.model_config().unwrap().clone();
    let tokens: Vec<u32> =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("tokens.json")).unwrap())
            .unwrap();
    let res = run(
        &ckpt,
        &RunOptions::new((0, cfg.num_hidden_layers - 1), tokens),
    )
    .expect("run");
    assert!(res.records.iter().any(|r| r.id == "head"));
    // the served path read the projections as NVFP4, the router gate as BF16
    let fmt = |op: &str| {
        res.records
            .iter()
            .find(|r| r.id == op)
            .unwrap_or_else(|| panic!("{op} not recorded"))
            .weights
            .clone()
    };
    let router = format!("L{}.ffn.router", cfg.num_hidden_layers - 1);
    eprintln!(
        "{family}: L0.attn.o reads {:?}, {router} {:?}",
        fmt("L0.attn.o"),
        fmt(&router)
    );
    assert!(fmt("L0.attn.o").iter().all(|(_, f)| f.starts_with("nvfp4")));
    assert!(fmt(&router).iter().all(|(_, f)| !f.starts_with("nvfp4")));
}

#[test]
fn qwen3_moe_compressed_tensors_nvfp4_reads_exactly_and_runs() {
    // 3 layers × (4 attention + 8 experts × 3) projections
    reads_and_runs("qwen3_moe", true, 3 * (4 + 24));
}

#[test]
fn qwen3_moe_modelopt_nvfp4_reads_exactly_and_runs() {
    reads_and_runs("qwen3_moe", false, 3 * (4 + 24));
}

#[test]
fn deepseek_v3_compressed_tensors_nvfp4_reads_exactly_and_runs() {
    // layer 0: 5 attention + 3 dense MLP; layers 1-2: 5 attention + 8 × 3 experts + 3 shared
    reads_and_runs("deepseek_v3", true, 8 + 2 * (5 + 24 + 3));
}

#[test]
fn deepseek_v3_modelopt_nvfp4_reads_exactly_and_runs() {
    reads_and_runs("deepseek_v3", false, 8 + 2 * (5 + 24 + 3));
}
