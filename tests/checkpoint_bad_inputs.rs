//! One test per kind of bad input: each must be an `Error` (never a panic) whose message names
//! the file and, where there is one, the tensor.

#[path = "checkpoint_common/mod.rs"]
mod common;

use common::*;
use nvfp4_probe::checkpoint::{writer, Checkpoint, Dtype};
use nvfp4_probe::Error;
use std::path::Path;

/// A valid two-tensor shard: `a` F32 [2] then `b` F32 [3].
fn two_tensor_shard() -> Vec<u8> {
    writer::serialize(
        &[
            ("a", Dtype::F32, &[2], &f32_bytes(&[1.0, 2.0])),
            ("b", Dtype::F32, &[3], &f32_bytes(&[3.0, 4.0, 5.0])),
        ],
        None,
    )
    .unwrap()
}

fn dir_with(shard: &[u8]) -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), CONFIG).unwrap();
    std::fs::write(d.path().join("model.safetensors"), shard).unwrap();
    d
}

/// The error is BadInput and its message names `file` (a suffix of the path) and `tensor`.
fn assert_bad(r: Result<Checkpoint, Error>, file: &str, tensor: Option<&str>) -> String {
    let e = r.expect_err("must fail");
    let msg = e.to_string();
    match &e {
        Error::BadInput {
            file: f, tensor: t, ..
        } => {
            assert!(
                f.ends_with(file),
                "file {f:?} should end with {file}: {msg}"
            );
            assert_eq!(t.as_deref(), tensor, "{msg}");
        }
        other => panic!("expected BadInput, got {other:?}"),
    }
    assert!(msg.contains(file), "{msg}");
    if let Some(t) = tensor {
        assert!(msg.contains(t), "{msg}");
    }
    msg
}

#[test]
fn truncated_shard() {
    let mut s = two_tensor_shard();
    s.truncate(s.len() - 5);
    let d = dir_with(&s);
    let msg = assert_bad(Checkpoint::open(d.path()), "model.safetensors", Some("b"));
    assert!(msg.contains("truncated"), "{msg}");
}

#[test]
fn shard_shorter_than_a_header() {
    let d = dir_with(&[1, 2, 3]);
    assert_bad(Checkpoint::open(d.path()), "model.safetensors", None);
}

#[test]
fn header_length_lies() {
    // Longer than the file.
    let mut s = two_tensor_shard();
    let lie = s.len() as u64 * 4;
    s[..8].copy_from_slice(&lie.to_le_bytes());
    let d = dir_with(&s);
    let msg = assert_bad(Checkpoint::open(d.path()), "model.safetensors", None);
    assert!(msg.contains("header length"), "{msg}");
    // Shorter than the header: the JSON is cut.
    let mut s = two_tensor_shard();
    let n = u64::from_le_bytes(s[..8].try_into().unwrap());
    s[..8].copy_from_slice(&(n - 9).to_le_bytes());
    let d = dir_with(&s);
    assert_bad(Checkpoint::open(d.path()), "model.safetensors", None);
}

#[test]
fn offsets_out_of_range() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[3],"data_offsets":[8,20]}}"#;
    let d = dir_with(&raw_file(h, &[0u8; 12]));
    let msg = assert_bad(Checkpoint::open(d.path()), "model.safetensors", Some("b"));
    assert!(msg.contains("[8, 20]"), "{msg}");
}

#[test]
fn overlapping_offsets() {
    let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}}"#;
    let d = dir_with(&raw_file(h, &[0u8; 12]));
    let msg = assert_bad(Checkpoint::open(d.path()), "model.safetensors", Some("b"));
    assert!(msg.contains("overlap"), "{msg}");
}

#[test]
fn offsets_disagree_with_shape() {
    let h = r#"{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}"#;
    let d = dir_with(&raw_file(h, &[0u8; 8]));
    assert_bad(Checkpoint::open(d.path()), "model.safetensors", Some("a"));
}

fn sharded_dir() -> tempfile::TempDir {
    let d = tempfile::tempdir().unwrap();
    let t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    write(d.path(), &t, CONFIG, 2000);
    d
}

#[test]
fn index_names_missing_shard() {
    let d = sharded_dir();
    let idx = d.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
    v["weight_map"]["head.weight"] = "model-00099-of-00099.safetensors".into();
    std::fs::write(&idx, serde_json::to_vec(&v).unwrap()).unwrap();
    let msg = assert_bad(
        Checkpoint::open(d.path()),
        "model.safetensors.index.json",
        Some("head.weight"),
    );
    assert!(msg.contains("model-00099-of-00099.safetensors"), "{msg}");
}

#[test]
fn index_names_tensor_not_in_shard() {
    let d = sharded_dir();
    let idx = d.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
    let first = v["weight_map"]["layers.0.attn.wq_a.weight"]
        .as_str()
        .unwrap()
        .to_string();
    v["weight_map"]["layers.0.attn.ghost.weight"] = first.clone().into();
    std::fs::write(&idx, serde_json::to_vec(&v).unwrap()).unwrap();
    let msg = assert_bad(
        Checkpoint::open(d.path()),
        "model.safetensors.index.json",
        Some("layers.0.attn.ghost.weight"),
    );
    assert!(msg.contains(&first), "{msg}");
}

#[test]
fn index_escaping_the_directory() {
    let d = sharded_dir();
    let idx = d.path().join("model.safetensors.index.json");
    let mut v: serde_json::Value = serde_json::from_slice(&std::fs::read(&idx).unwrap()).unwrap();
    v["weight_map"]["head.weight"] = "../elsewhere.safetensors".into();
    std::fs::write(&idx, serde_json::to_vec(&v).unwrap()).unwrap();
    assert_bad(
        Checkpoint::open(d.path()),
        "model.safetensors.index.json",
        Some("head.weight"),
    );
}

#[test]
fn unreadable_config() {
    let d = dir_with(&two_tensor_shard());
    std::fs::remove_file(d.path().join("config.json")).unwrap();
    std::fs::create_dir(d.path().join("config.json")).unwrap(); // exists, cannot be read as a file
    assert_bad(Checkpoint::open(d.path()), "config.json", None);
    std::fs::remove_dir(d.path().join("config.json")).unwrap();
    assert_bad(Checkpoint::open(d.path()), "config.json", None);
}

#[test]
fn non_json_config() {
    let d = dir_with(&two_tensor_shard());
    std::fs::write(d.path().join("config.json"), "hidden_size = 64\n").unwrap();
    let msg = assert_bad(Checkpoint::open(d.path()), "config.json", None);
    assert!(msg.contains("JSON"), "{msg}");
    // JSON, but not a DeepSeek config: open works, model_config names the file and the field.
    std::fs::write(d.path().join("config.json"), r#"{"hidden_size": 64}"#).unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    let msg = ck.model_config().unwrap_err().to_string();
    assert!(
        msg.contains("config.json") && msg.contains("num_hidden_layers"),
        "{msg}"
    );
}

/// Write the official layer with one tensor replaced, then ask for `base`'s weight.
fn layer_with(replace: &str, dtype: Dtype, shape: &[usize], bytes: Vec<u8>, base: &str) -> Error {
    let d = tempfile::tempdir().unwrap();
    let mut t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    let k = t
        .iter()
        .position(|x| x.0 == replace)
        .unwrap_or_else(|| panic!("{replace}"));
    t[k] = (replace.to_string(), dtype, shape.to_vec(), bytes);
    write(d.path(), &t, CONFIG, usize::MAX);
    let ck = Checkpoint::open(d.path()).unwrap();
    ck.weight(base).expect_err("must fail")
}

fn assert_bad_err(e: Error, tensor: &str) -> String {
    let msg = e.to_string();
    assert!(matches!(e, Error::BadInput { .. }), "{e:?}");
    assert!(
        msg.contains("model.safetensors") && msg.contains(tensor),
        "{msg}"
    );
    msg
}

#[test]
fn shape_contradicts_config() {
    // wq_a must be [q_lora_rank 32, hidden 64]; store [32, 48].
    let e = layer_with(
        "layers.0.attn.wq_a.weight",
        Dtype::BF16,
        &[32, 48],
        bf16_bytes(&vec![1.0; 32 * 48]),
        "layers.0.attn.wq_a",
    );
    let msg = assert_bad_err(e, "layers.0.attn.wq_a.weight");
    assert!(
        msg.contains("[32, 64]") && msg.contains("q_lora_rank"),
        "{msg}"
    );
    // A packed expert whose logical in_features (2 × packed cols) is wrong.
    let e = layer_with(
        "layers.0.ffn.experts.1.w1.weight",
        Dtype::U8,
        &[32, 16],
        vec![0x11; 32 * 16],
        "layers.0.ffn.experts.1.w1",
    );
    assert_bad_err(e, "layers.0.ffn.experts.1.w1");
}

#[test]
fn dtype_contradicts_scheme() {
    // NVFP4 block scales stored as F32 instead of F8_E4M3.
    let e = layer_with(
        "layers.0.attn.wo_b.weight_scale",
        Dtype::F32,
        &[64, 2],
        f32_bytes(&vec![1.0; 128]),
        "layers.0.attn.wo_b",
    );
    assert_bad_err(e, "layers.0.attn.wo_b.weight_scale");
    // A linear weight stored as I64.
    let e = layer_with(
        "head.weight",
        Dtype::I64,
        &[32, 64],
        vec![0; 32 * 64 * 8],
        "head",
    );
    assert_bad_err(e, "head.weight");
    // Block scales of the wrong shape.
    let e = layer_with(
        "layers.0.attn.wo_b.weight_scale",
        Dtype::F8_E4M3,
        &[64, 4],
        vec![0x38; 256],
        "layers.0.attn.wo_b",
    );
    assert_bad_err(e, "layers.0.attn.wo_b.weight_scale");
    // The tensor scale must be a scalar.
    let e = layer_with(
        "layers.0.attn.wo_b.weight_scale_2",
        Dtype::F32,
        &[2],
        f32_bytes(&[1.0, 1.0]),
        "layers.0.attn.wo_b",
    );
    assert_bad_err(e, "layers.0.attn.wo_b.weight_scale_2");
}

fn layer_without(drop: &str, config: &str) -> (tempfile::TempDir, Checkpoint) {
    let d = tempfile::tempdir().unwrap();
    let mut t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    t.retain(|x| x.0 != drop);
    write(d.path(), &t, config, usize::MAX);
    let ck = Checkpoint::open(d.path()).unwrap();
    (d, ck)
}

fn assert_missing(e: Error, tensor: &str, dir: &Path) {
    let msg = e.to_string();
    match &e {
        Error::MissingTensor { tensor: t, .. } => assert_eq!(t, tensor, "{msg}"),
        other => panic!("expected MissingTensor, got {other:?}"),
    }
    assert!(msg.contains(tensor), "{msg}");
    assert!(
        msg.contains(&dir.join("model.safetensors").display().to_string()),
        "{msg}"
    );
}

#[test]
fn missing_scale_tensor() {
    for (drop, base) in [
        ("layers.0.attn.wq_b.scale", "layers.0.attn.wq_b"),
        (
            "layers.0.attn.wo_a.weight_global_scale",
            "layers.0.attn.wo_a",
        ),
        ("layers.0.attn.wo_b.weight_scale_2", "layers.0.attn.wo_b"),
        ("layers.0.attn.wo_b.weight_scale", "layers.0.attn.wo_b"),
        (
            "layers.0.ffn.experts.0.w1.scale",
            "layers.0.ffn.experts.0.w1",
        ),
    ] {
        let (d, ck) = layer_without(drop, CONFIG);
        let e = ck.weight(base).expect_err(drop);
        assert_missing(e, drop, d.path());
    }
}

#[test]
fn missing_activation_scale_is_not_an_error() {
    let (_d, ck) = layer_without("layers.0.attn.wo_b.input_scale", CONFIG);
    let w = ck.weight_meta("layers.0.attn.wo_b").unwrap();
    assert_eq!(w.input_global, None);
    assert_eq!(w.tensors.input_scale, None);
}

#[test]
fn fp8_block_size_from_config_must_fit_scales() {
    // Scales written for 128×128 blocks, config says 16×16.
    let d = tempfile::tempdir().unwrap();
    let t = tensors(&official_layer([128, 128]), |b, s| format!("{b}.{s}"));
    write(d.path(), &t, &config_with_block([16, 16]), usize::MAX);
    let ck = Checkpoint::open(d.path()).unwrap();
    let msg = assert_bad_err(
        ck.weight("layers.0.attn.wq_b").unwrap_err(),
        "layers.0.attn.wq_b.scale",
    );
    assert!(msg.contains("weight_block_size"), "{msg}");
}

#[test]
fn missing_weight() {
    let (d, ck) = layer_without("head.weight", CONFIG);
    let e = ck.weight("head").unwrap_err();
    match &e {
        Error::MissingTensor { tensor, dir, .. } => {
            assert_eq!(tensor, "head.weight");
            assert_eq!(dir, d.path());
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn empty_directory() {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), CONFIG).unwrap();
    let e = Checkpoint::open(d.path()).unwrap_err();
    assert!(matches!(e, Error::BadInput { .. }), "{e:?}");
    assert!(Checkpoint::open(&d.path().join("nope")).is_err());
}

#[test]
fn in_memory_errors_name_builtin() {
    let mut s = two_tensor_shard();
    s.truncate(s.len() - 1);
    let e = Checkpoint::from_memory(CONFIG, vec![("model.safetensors".into(), s)]).unwrap_err();
    assert!(
        e.to_string().contains("<built-in>/model.safetensors"),
        "{e}"
    );
    let e = Checkpoint::from_memory("{", vec![("model.safetensors".into(), two_tensor_shard())])
        .unwrap_err();
    assert!(e.to_string().contains("<built-in>/config.json"), "{e}");
}

#[test]
fn random_garbage_never_panics() {
    let mut r = Rng::new(77);
    let good = two_tensor_shard();
    for _ in 0..300 {
        let mut s = good.clone();
        for _ in 0..1 + r.below(4) {
            let k = r.below(s.len());
            s[k] = r.next() as u8;
        }
        if r.below(3) == 0 {
            s.truncate(r.below(s.len()));
        }
        let res = std::panic::catch_unwind(|| {
            Checkpoint::from_memory(CONFIG, vec![("model.safetensors".into(), s)])
        });
        let res = res.expect("no panic");
        if let Ok(ck) = res {
            for n in ck.tensor_names() {
                let _ = ck.tensor_f32(&n);
            }
        }
    }
}
