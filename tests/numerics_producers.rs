//! Re-encode the BF16 producer fixtures (tests/data/producers, made with
//! compressed-tensors 0.20.0 and ModelOpt 0.47.0) and compare with the bytes those libraries
//! wrote; decode their bytes and compare with their own f32 dequantisation.

use nvfp4_probe::numerics::e4m3;
use nvfp4_probe::numerics::nvfp4::{self, Convention};
use safetensors::{Dtype, SafeTensors};

const DIR: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/producers/");
const MODULES: [&str; 6] = [
    "case.gaussian",
    "case.outlier_rows",
    "case.zero_blocks",
    "case.tiny",
    "case.heavy_tail",
    "case.ties",
];
const TIES: [f64; 7] = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0];

fn read(name: &str) -> Vec<u8> {
    std::fs::read(format!("{DIR}{name}")).unwrap_or_else(|e| panic!("{DIR}{name}: {e}"))
}

fn f32s(st: &SafeTensors, name: &str) -> (Vec<f32>, Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    let v = t
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (v, t.shape().to_vec())
}

fn bytes(st: &SafeTensors, name: &str, dt: Dtype) -> (Vec<u8>, Vec<usize>) {
    let t = st.tensor(name).unwrap_or_else(|e| panic!("{name}: {e}"));
    assert_eq!(t.dtype(), dt, "{name}");
    (t.data().to_vec(), t.shape().to_vec())
}

fn bf16_weight(st: &SafeTensors, m: &str) -> (Vec<f32>, usize, usize) {
    let t = st.tensor(&format!("{m}.weight")).unwrap();
    assert_eq!(t.dtype(), Dtype::BF16);
    let w = t
        .data()
        .chunks_exact(2)
        .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
        .collect();
    (w, t.shape()[0], t.shape()[1])
}

/// Counts nibble mismatches; panics on any that is not an allowed near-tie flip (one E2M1 step,
/// same sign, where the exact scaled value x·2688/(amax·s) is a rounding tie).
fn nibble_mismatches(
    w: &[f32],
    amax: f32,
    mine: &[u8],
    theirs: &[u8],
    scales: &[u8],
    what: &str,
) -> usize {
    let mut n = 0;
    for (i, (&a, &b)) in mine.iter().zip(theirs).enumerate() {
        for (k, (ca, cb)) in [(a & 0xF, b & 0xF), (a >> 4, b >> 4)]
            .into_iter()
            .enumerate()
        {
            if ca == cb || (ca & 7 == 0 && cb & 7 == 0) {
                continue;
            }
            n += 1;
            let e = 2 * i + k;
            let s = e4m3::decode(scales[e / 16]) as f64;
            let y = (w[e] as f64 * 2688.0 / (amax as f64 * s)).abs();
            let at_tie = TIES.iter().any(|t| (y / t - 1.0).abs() < 1e-6);
            let one_step = (ca & 8) == (cb & 8) && ((ca & 7) as i32 - (cb & 7) as i32).abs() == 1;
            assert!(
                at_tie && one_step,
                "{what}: element {e} mine {ca:#x} theirs {cb:#x}, |y| = {y}"
            );
        }
    }
    n
}

#[test]
fn compressed_tensors_bytes_reproduced() {
    let wb = read("weights-bf16.safetensors");
    let cb = read("ct-nvfp4.safetensors");
    let ws = SafeTensors::deserialize(&wb).unwrap();
    let cs = SafeTensors::deserialize(&cb).unwrap();
    let (mut total, mut diff) = (0usize, 0usize);
    for m in MODULES {
        let (w, rows, cols) = bf16_weight(&ws, m);
        let (g, gshape) = f32s(&cs, &format!("{m}.weight_global_scale"));
        assert_eq!(gshape, vec![1]);
        let (packed, _) = bytes(&cs, &format!("{m}.weight_packed"), Dtype::U8);
        let (scales, sshape) = bytes(&cs, &format!("{m}.weight_scale"), Dtype::F8_E4M3);
        assert_eq!(sshape, vec![rows, cols / 16]);
        let q = nvfp4::quantize_ct(&w, rows, cols);
        assert_eq!(q.global.to_bits(), g[0].to_bits(), "{m}: global scale");
        let bad = q.scales.iter().zip(&scales).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{m}: scale bytes");
        let amax = nvfp4::amax(&w);
        diff += nibble_mismatches(&w, amax, &q.packed, &packed, &scales, m);
        total += rows * cols;
    }
    assert_eq!(total, 240_640);
    // The fixture README: an encoder doing the f32 steps in the producer's order reproduces
    // every nibble. The looser §-contract (≥ 99.9 %, ties only) is checked per element above.
    assert_eq!(diff, 0, "CT nibble mismatches");
}

#[test]
fn modelopt_bytes_reproduced() {
    let wb = read("weights-bf16.safetensors");
    let mb = read("modelopt-nvfp4.safetensors");
    let ws = SafeTensors::deserialize(&wb).unwrap();
    let ms = SafeTensors::deserialize(&mb).unwrap();
    let mut diff = 0usize;
    for m in MODULES {
        let (w, rows, cols) = bf16_weight(&ws, m);
        let (d, dshape) = f32s(&ms, &format!("{m}.weight_scale_2"));
        assert!(dshape.is_empty(), "{m}: weight_scale_2 is 0-dim");
        let (packed, _) = bytes(&ms, &format!("{m}.weight"), Dtype::U8);
        let (scales, _) = bytes(&ms, &format!("{m}.weight_scale"), Dtype::F8_E4M3);
        let q = nvfp4::quantize_modelopt(&w, rows, cols);
        assert_eq!(q.global.to_bits(), d[0].to_bits(), "{m}: weight_scale_2");
        let bad = q.scales.iter().zip(&scales).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{m}: scale bytes");
        diff += nibble_mismatches(&w, nvfp4::amax(&w), &q.packed, &packed, &scales, m);
    }
    assert_eq!(diff, 0, "ModelOpt nibble mismatches");
}

/// Spot checks the README documents: zero blocks, underflow blocks and scale ties differ
/// between the producers exactly as listed.
#[test]
fn documented_producer_differences() {
    let wb = read("weights-bf16.safetensors");
    let ws = SafeTensors::deserialize(&wb).unwrap();
    let (w, r, c) = bf16_weight(&ws, "case.zero_blocks");
    let (ct, mo) = (
        nvfp4::quantize_ct(&w, r, c),
        nvfp4::quantize_modelopt(&w, r, c),
    );
    let nb = c / 16;
    assert_eq!((ct.scales[9 * nb], mo.scales[9 * nb]), (0x20, 0x38)); // zero row 9
    assert_eq!(
        (ct.scales[30 * nb + 2], mo.scales[30 * nb + 2]),
        (0x20, 0x38)
    ); // −0.0 block
    assert!(ct.packed[30 * c / 2 + 16..30 * c / 2 + 24]
        .iter()
        .all(|&b| b == 0));
    let zero_ct = ct.scales.iter().filter(|&&b| b == 0x20).count();
    assert_eq!(zero_ct, 64);
    let (w, r, c) = bf16_weight(&ws, "case.tiny");
    let (ct, mo) = (
        nvfp4::quantize_ct(&w, r, c),
        nvfp4::quantize_modelopt(&w, r, c),
    );
    let nb = c / 16;
    assert_eq!(
        (ct.scales[62 * nb + 1], mo.scales[62 * nb + 1]),
        (0x04, 0x03)
    );
    let underflow: Vec<_> = (0..r * nb)
        .filter(|&b| ct.scales[b] == 0x20 && mo.scales[b] == 0x01)
        .collect();
    assert_eq!(underflow.len(), 8);
    assert!(underflow.iter().all(|&b| b / nb == 1 || b / nb == 2));
    let (w, r, c) = bf16_weight(&ws, "case.ties");
    let (ct, mo) = (
        nvfp4::quantize_ct(&w, r, c),
        nvfp4::quantize_modelopt(&w, r, c),
    );
    assert_eq!(ct.global, 448.0);
    let nb = c / 16;
    for b in [15 * nb + 2, 15 * nb + 3] {
        assert_eq!((ct.scales[b], mo.scales[b]), (0x04, 0x03));
    }
}

#[test]
fn decoders_match_producer_dequantisation() {
    let cb = read("ct-nvfp4.safetensors");
    let mb = read("modelopt-nvfp4.safetensors");
    let db = read("dequant-f32.safetensors");
    let cs = SafeTensors::deserialize(&cb).unwrap();
    let ms = SafeTensors::deserialize(&mb).unwrap();
    let ds = SafeTensors::deserialize(&db).unwrap();
    for m in MODULES {
        let (want_ct, shape) = f32s(&ds, &format!("{m}:ct"));
        let (rows, cols) = (shape[0], shape[1]);
        let (packed, _) = bytes(&cs, &format!("{m}.weight_packed"), Dtype::U8);
        let (scales, _) = bytes(&cs, &format!("{m}.weight_scale"), Dtype::F8_E4M3);
        let (g, _) = f32s(&cs, &format!("{m}.weight_global_scale"));
        let got = nvfp4::dequantize(
            &packed,
            &scales,
            g[0],
            Convention::CompressedTensors,
            rows,
            cols,
        );
        let bad = got.iter().zip(&want_ct).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{m}: CT dequant");
        // compressed-tensors writes −0.0 for code 0x8, as our decoder does: bit-exact too.
        assert!(
            got.iter()
                .zip(&want_ct)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{m}: CT bits"
        );

        let (want_mo, _) = f32s(&ds, &format!("{m}:modelopt"));
        let (packed, _) = bytes(&ms, &format!("{m}.weight"), Dtype::U8);
        let (scales, _) = bytes(&ms, &format!("{m}.weight_scale"), Dtype::F8_E4M3);
        let (d, _) = f32s(&ms, &format!("{m}.weight_scale_2"));
        let got = nvfp4::dequantize(&packed, &scales, d[0], Convention::ModelOpt, rows, cols);
        let bad = got.iter().zip(&want_mo).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "{m}: ModelOpt dequant");
        // Sanity that the comparison sees real data: non-zero values in every module.
        assert!(want_mo.iter().any(|&v| v != 0.0));
    }
}
