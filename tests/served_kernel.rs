//! The served path's W4A4 linear reproduces the serving kernel's numerics: docs/NVFP4.md §4.3 reference GEMM
//! (exact per-block partials, f64 across blocks, bf16(alpha·acc)) on the §9 vectors and on random data.

use nvfp4_probe::checkpoint::{Checkpoint, Naming};
use nvfp4_probe::device::gemm::matmul_nt;
use nvfp4_probe::model::family::kind::Kind;
use nvfp4_probe::numerics::fp8_block;
use nvfp4_probe::numerics::{bf16, e2m1, e4m3, nvfp4};
use nvfp4_probe::served::{apply, prepare, ExactAct, Nvfp4Params, Profile, ServedWeight};
use nvfp4_probe::synth::{synth_to_memory, Format, Preset, SynthOptions};

fn wq_of(packed: &[u8], scales: &[u8], rows: usize, cols: usize) -> Vec<f32> {
    // e2m1 · s_w, straight from the format definition (docs/NVFP4.md §1, §3.1)
    let nb = cols / 16;
    (0..rows * cols)
        .map(|i| {
            let (r, c) = (i / cols, i % cols);
            let byte = packed[i / 2];
            let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
            e2m1::decode(code) * e4m3::decode(scales[r * nb + c / 16])
        })
        .collect()
}

struct Lcg(u64);
impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // approx normal: sum of 4 uniforms
        let mut s = 0f32;
        for k in 0..4 {
            s += ((self.0 >> (16 + 8 * k)) & 0xFF) as f32 / 255.0;
        }
        s - 2.0
    }
}

#[test]
fn tv12_exact() {
    // x = 16 × 1.0 (g_x = 2688), w = 16 × 0.5 (g_w = 5376): y = 8.0 exactly
    let x = vec![1.0f32; 16];
    let w = vec![0.5f32; 16];
    let wq = nvfp4::quantize_activation(&w, 1, 16, 5376.0);
    let sw = ServedWeight::Nvfp4 {
        wq: wq_of(&wq.packed, &wq.scales, 1, 16).into(),
        p: Nvfp4Params {
            g_x: 2688.0,
            d_w: 1.0 / 5376.0,
            alpha: (1.0 / 2688.0f32) * (1.0 / 5376.0f32),
        },
    };
    let (y, obs) = apply(&sw, Profile::BlackwellW4a4, &x, 1, 16, 1);
    assert_eq!(y, vec![8.0]);
    let h = obs.health.unwrap();
    assert_eq!(h.blocks, 1);
    assert_eq!(h.scale_max, 1); // block scale 448 = 0x7E
}

#[test]
fn random_w4a4_matches_reference_gemm() {
    let (m, n, k) = (37, 48, 256);
    let mut rng = Lcg(42);
    let x: Vec<f32> = (0..m * k).map(|_| bf16::round(rng.next() * 3.0)).collect();
    let w: Vec<f32> = (0..n * k).map(|_| bf16::round(rng.next() * 0.05)).collect();
    let wq = nvfp4::quantize_modelopt(&w, n, k);
    let d_w = wq.global;
    let amax_calib = x.iter().fold(0f32, |a, v| a.max(v.abs())) * 0.9; // slightly saturating calibration
    let d_x = amax_calib / 2688.0;
    let g_x = 1.0 / d_x;
    let alpha = d_x * d_w;
    let sw = ServedWeight::Nvfp4 {
        wq: wq_of(&wq.packed, &wq.scales, n, k).into(),
        p: Nvfp4Params { g_x, d_w, alpha },
    };
    let (y, _) = apply(&sw, Profile::BlackwellW4a4, &x, m, k, n);
    let xa = nvfp4::quantize_activation(&x, m, k, g_x);
    let r = nvfp4::gemm_w4a4_reference(
        &xa.packed, &xa.scales, &wq.packed, &wq.scales, m, n, k, alpha,
    );
    let mut same = 0;
    for (a, b) in y.iter().zip(&r) {
        if a.to_bits() == b.to_bits() {
            same += 1;
        } else {
            // only accumulation order differs: at most one bf16 ulp
            let ulp = (b.abs() * 2f32.powi(-7)).max(1e-30);
            assert!((a - b).abs() <= ulp, "{a} vs {b}");
        }
    }
    // the served GEMM accumulates in f64 like the reference: every output bit-identical
    assert_eq!(same, y.len(), "only {same}/{} bit-identical", y.len());
}

#[test]
fn random_w4a16_matches_marlin_reference() {
    let (m, n, k) = (9, 32, 128);
    let mut rng = Lcg(7);
    let x: Vec<f32> = (0..m * k).map(|_| bf16::round(rng.next())).collect();
    let w: Vec<f32> = (0..n * k).map(|_| bf16::round(rng.next() * 0.1)).collect();
    let wq = nvfp4::quantize_ct(&w, n, k);
    let d_w = 1.0 / wq.global;
    let sw = ServedWeight::Nvfp4 {
        wq: wq_of(&wq.packed, &wq.scales, n, k).into(),
        p: Nvfp4Params {
            g_x: f32::NAN,
            d_w,
            alpha: f32::NAN,
        }, // W4A16 ignores the activation scale
    };
    let (y, _) = apply(&sw, Profile::HopperW4a16, &x, m, k, n);
    let r = nvfp4::gemm_w4a16_reference(&x, &wq.packed, &wq.scales, m, n, k, d_w);
    for (a, b) in y.iter().zip(&r) {
        let ulp = (b.abs() * 2f32.powi(-7)).max(1e-30);
        assert!((a - b).abs() <= ulp, "{a} vs {b}");
        assert!(a.is_finite());
    }
}

/// The CPU GEMM is the f64 sum of exact products rounded once to f32: a naive f64 loop in the
/// opposite summation order gives the same bits (this is what lets the CUDA backend match it).
#[test]
fn matmul_is_the_f64_sum_rounded_once() {
    let (m, n, k) = (5, 1500, 777);
    let mut rng = Lcg(99);
    let x: Vec<f32> = (0..m * k).map(|_| rng.next() * 4.0).collect();
    let w: Vec<f32> = (0..n * k).map(|_| rng.next() * 0.3).collect();
    let y = nvfp4_probe::device::gemm::matmul_nt(&x, &w, m, k, n);
    let mut same = 0;
    for r in 0..m {
        for c in 0..n {
            let mut acc = 0f64;
            for i in (0..k).rev() {
                acc += x[r * k + i] as f64 * w[c * k + i] as f64;
            }
            same += (y[r * n + c].to_bits() == (acc as f32).to_bits()) as usize;
        }
    }
    // an f64 rounding difference can move an f32 rounding only within ~1e-7 of a tie
    assert!(same + 2 >= m * n, "{same} of {} bit-equal", m * n);
}

/// An MXFP4 expert's served linear multiplies the exact weight with the activation its
/// family's engines give it: gpt-oss MXFP8 under blackwell-w4a4 (W4A8), the BF16 activation
/// under hopper-w4a16 and emulation (W4A16); V4's MXFP4 experts DeepSeek's FP8 1×128 under
/// every profile. Each is checked against the activation quantizer applied by hand and an f32
/// GEMM of the dequantized weight, rounded to BF16.
#[test]
fn exact_served_activation_follows_the_family_recipe() {
    let oss = synth_to_memory(&SynthOptions::family(Kind::GptOss, Format::Mxfp4, 5)).unwrap();
    let v4 = synth_to_memory(&SynthOptions::new(
        Preset::Tiny,
        Format::Mxfp4,
        Naming::Hf,
        5,
    ))
    .unwrap();
    let cases: [(&Checkpoint, [ExactAct; 3]); 2] = [
        (&oss, [ExactAct::Mxfp8, ExactAct::Bf16, ExactAct::Bf16]),
        (&v4, [ExactAct::Fp8x128; 3]),
    ];
    for (ck, acts) in cases {
        let base = "layers.1.ffn.experts.0.w2";
        let qw = ck.weight(base).unwrap();
        assert_eq!(qw.format.scheme(), nvfp4_probe::checkpoint::Scheme::Mxfp4);
        let (n, k) = (qw.out_features, qw.in_features);
        let w = qw.dequantize().unwrap().data.into_vec();
        let sw = prepare(ck, &qw, &w, true, &[], &[]).unwrap();
        let m = 5;
        let mut rng = nvfp4_probe::model::mem_env::Rng::new(11);
        // blocks of 32 a factor 2^8 apart: a 1x128 group's scale takes the smallest block's
        // values into E4M3's subnormals, the MXFP8 block's own scale does not
        let x: Vec<f32> = (0..m * k)
            .map(|i| {
                let tier = 2f64.powi(-8 * ((i % k) / 32 % 3) as i32);
                bf16::round((rng.normal() * 3.0 * tier) as f32)
            })
            .collect();
        let quantized = |a: ExactAct| match a {
            ExactAct::Mxfp8 => fp8_block::fake_quant_act_mxfp8(&x, m, k),
            ExactAct::Bf16 => x.clone(),
            ExactAct::Fp8x128 => {
                fp8_block::fake_quant_act_1x128(&x, m, k, fp8_block::ActScale::DeepSeekPow2)
            }
        };
        // the three differ on these inputs, so each comparison below picks its recipe
        let all = [ExactAct::Mxfp8, ExactAct::Bf16, ExactAct::Fp8x128].map(quantized);
        assert!(all[0] != all[1] && all[1] != all[2] && all[0] != all[2]);
        for (profile, act) in Profile::ALL.into_iter().zip(acts) {
            let xq = quantized(act);
            let want: Vec<f32> = matmul_nt(&xq, &w, m, k, n)
                .into_iter()
                .map(bf16::round)
                .collect();
            let (y, _) = apply(&sw, profile, &x, m, k, n);
            assert_eq!(y, want, "{} {act:?}", profile.name());
        }
    }
}
