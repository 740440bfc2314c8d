//! The producer fixtures (compressed-tensors 0.20.0 and ModelOpt 0.47.0 bytes) read through
//! `Checkpoint::open` must dequantise to each producer's own f32 output exactly (f32 ==).

use nvfp4_probe::checkpoint::{Checkpoint, Naming, WeightFormat};
use nvfp4_probe::numerics::nvfp4::Convention;
use std::path::{Path, PathBuf};

const CASES: [&str; 6] = [
    "case.gaussian",
    "case.heavy_tail",
    "case.outlier_rows",
    "case.ties",
    "case.tiny",
    "case.zero_blocks",
];

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/data/producers")
}

/// Copy one producer file into a fresh checkpoint directory with a minimal config.
fn checkpoint_of(file: &str) -> (tempfile::TempDir, Checkpoint) {
    let d = tempfile::tempdir().unwrap();
    std::fs::copy(fixtures().join(file), d.path().join("model.safetensors")).unwrap();
    std::fs::write(d.path().join("config.json"), "{}").unwrap();
    let ck = Checkpoint::open(d.path()).unwrap();
    (d, ck)
}

/// Reference values read with the safetensors crate directly (not through `Checkpoint`).
fn reference(name: &str) -> (Vec<usize>, Vec<f32>) {
    let buf = std::fs::read(fixtures().join("dequant-f32.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&buf).unwrap();
    let v = st.tensor(name).unwrap();
    assert_eq!(v.dtype(), safetensors::Dtype::F32);
    let data = v
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (v.shape().to_vec(), data)
}

fn check(file: &str, tag: &str, scheme: &str, conv: Convention) {
    if !Path::new(&fixtures().join(file)).exists() {
        panic!("fixture {file} missing under {}", fixtures().display());
    }
    let (_d, ck) = checkpoint_of(file);
    assert_eq!(ck.naming(), Naming::Official);
    let mut bases = ck.weight_bases();
    bases.sort();
    assert_eq!(bases, CASES);
    for case in CASES {
        let w = ck.weight(case).unwrap();
        assert_eq!(w.scheme(), scheme);
        match &w.format {
            WeightFormat::Nvfp4 {
                convention,
                input_global,
                ..
            } => {
                assert_eq!(*convention, conv);
                assert_eq!(*input_global, None, "fixtures carry no activation scales");
            }
            other => panic!("{case}: {other:?}"),
        }
        let t = w.dequantize().unwrap();
        let (shape, want) = reference(&format!("{case}:{tag}"));
        assert_eq!(t.shape, shape, "{case}");
        let bad = t.data.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{case}:{tag}: {bad} values differ");
    }
}

#[test]
fn compressed_tensors_fixture_dequantises_exactly() {
    check(
        "ct-nvfp4.safetensors",
        "ct",
        "nvfp4-ct",
        Convention::CompressedTensors,
    );
}

#[test]
fn modelopt_fixture_dequantises_exactly() {
    check(
        "modelopt-nvfp4.safetensors",
        "modelopt",
        "nvfp4-modelopt",
        Convention::ModelOpt,
    );
}

/// Global scales as stored, per the fixture README's table.
#[test]
fn fixture_global_scales_as_stored() {
    let (_d, ct) = checkpoint_of("ct-nvfp4.safetensors");
    let (_e, mo) = checkpoint_of("modelopt-nvfp4.safetensors");
    let g = ct.weight_meta("case.ties").unwrap().weight_global.unwrap();
    let d = mo.weight_meta("case.ties").unwrap().weight_global.unwrap();
    assert_eq!(g, 448.0);
    assert_eq!(d, 0.002_232_143);
    assert_eq!(
        ct.weight_meta("case.tiny").unwrap().weight_global,
        Some(336.0)
    );
}
