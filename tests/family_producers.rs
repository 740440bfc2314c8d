//! The families' checkpoints made by the producers themselves (tests/data/hf-families/*/
//! {ct-nvfp4,modelopt-nvfp4}: compressed-tensors 0.20.0 and ModelOpt 0.47.0 quantizing the tiny
//! transformers-made Qwen3-MoE and DeepSeek-V3, see that folder's README): every weight whose
//! producer dequantization is kept beside the checkpoint (`dequant-layer1.safetensors`, keyed by
//! the BF16 name) resolves to a canonical NVFP4 weight of the producer's convention whose
//! dequantization equals the producer's own, value by value; and `lint` finds no error.

use std::path::{Path, PathBuf};

use nvfp4_probe::checkpoint::Checkpoint;
use nvfp4_probe::lint::{lint_dir, Rules, Severity};
use safetensors::SafeTensors;

fn dir(family: &str, kind: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data/hf-families")
        .join(family)
        .join(kind)
}

fn check(family: &str, kind: &str, scheme: &str, min: usize) {
    let d = dir(family, kind);
    let ck = Checkpoint::open(&d).unwrap();
    let bytes = std::fs::read(d.join("dequant-layer1.safetensors")).unwrap();
    let deq = SafeTensors::deserialize(&bytes).unwrap();
    let mut n = 0;
    for (name, t) in deq.tensors() {
        let module = name.strip_suffix(".weight").unwrap();
        let canon = ck
            .canonical_of(&format!("{module}.weight_scale"))
            .unwrap_or_else(|| panic!("{family}/{kind} {module}: no canonical name"))
            .strip_suffix(".weight_scale")
            .unwrap()
            .to_string();
        let w = ck.weight(&canon).unwrap();
        assert_eq!(w.scheme(), scheme, "{family}/{kind} {module}");
        let got = w.dequantize().unwrap();
        let want: Vec<f32> = t
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(got.data.len(), want.len(), "{family}/{kind} {module}");
        let bad = got.data.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(
            bad, 0,
            "{family}/{kind} {module}: {bad} values differ from the producer's dequantization"
        );
        n += 1;
    }
    assert!(n >= min, "{family}/{kind}: {n} weights checked");
    let r = lint_dir(&d, None, &Rules::default()).unwrap();
    let errors: Vec<_> = r
        .findings
        .iter()
        .filter(|f| f.severity >= Severity::Error)
        .map(|f| format!("{} {}", f.rule, f.evidence))
        .collect();
    assert!(errors.is_empty(), "{family}/{kind}: {errors:?}");
}

#[test]
fn qwen3_moe_compressed_tensors() {
    check("qwen3_moe", "ct-nvfp4", "nvfp4-ct", 10);
}

#[test]
fn qwen3_moe_modelopt() {
    check("qwen3_moe", "modelopt-nvfp4", "nvfp4-modelopt", 10);
}

#[test]
fn deepseek_v3_compressed_tensors() {
    check("deepseek_v3", "ct-nvfp4", "nvfp4-ct", 14);
}

#[test]
fn deepseek_v3_modelopt() {
    check("deepseek_v3", "modelopt-nvfp4", "nvfp4-modelopt", 9);
}
