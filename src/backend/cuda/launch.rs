//! Typed launchers, one per kernel of `kernels/*.cu`: `gpu.kern().round_bf16(n, x, x, n, 0)`.
//! Each launcher's parameters are the kernel's own, in its order, with its C types (`ptr` is a
//! device address); a launch with a wrong count or kind of arguments does not compile, where a
//! launch by name with an `A` slice failed (or misread its arguments) only on the device. The
//! list below is also the table of kernels the module loads ([`KERNELS`]).

use super::*;

/// Where a launch runs: over `n` work items with the kernel's grid ([`Gpu::grid`]), or an
/// explicit grid, block and shared memory.
pub enum Grid {
    Items(u64),
    Cfg(LaunchConfig),
}

impl From<u64> for Grid {
    fn from(n: u64) -> Grid {
        Grid::Items(n)
    }
}

impl From<LaunchConfig> for Grid {
    fn from(c: LaunchConfig) -> Grid {
        Grid::Cfg(c)
    }
}

/// The typed launchers of one device ([`Gpu::kern`]).
pub struct Kern<'g>(&'g Gpu);

impl Gpu {
    /// The typed kernel launchers.
    pub fn kern(&self) -> Kern<'_> {
        Kern(self)
    }
}

macro_rules! arg {
    (ptr, $v:expr) => {
        A::P($v)
    };
    (u64, $v:expr) => {
        A::U($v)
    };
    (i32, $v:expr) => {
        A::I($v)
    };
    (f32, $v:expr) => {
        A::F($v)
    };
    (u32, $v:expr) => {
        A::U32($v)
    };
}

macro_rules! ty {
    (ptr) => {
        u64
    };
    ($t:ident) => {
        $t
    };
}

macro_rules! kernels {
    ($( $(#[$m:meta])* $file:literal fn $name:ident($($a:ident: $t:ident),* $(,)?); )*) => {
        /// Every kernel the module loads, by name.
        pub(super) const KERNELS: &[&str] = &[$(stringify!($name)),*];

        /// Each kernel's number of parameters (checked against the sources by a test).
        #[cfg(test)]
        const ARITY: &[(&str, usize)] = &[$((stringify!($name), [$(stringify!($a)),*].len())),*];

        #[allow(dead_code, clippy::too_many_arguments)]
        impl Kern<'_> {
            $(
                $(#[$m])*
                #[doc = concat!("\n\n`", stringify!($name), "` in kernels/", $file, ".")]
                pub fn $name(&self, grid: impl Into<Grid>, $($a: ty!($t)),*) -> Result<()> {
                    let args = [$(arg!($t, $a)),*];
                    match grid.into() {
                        Grid::Items(n) => self.0.launch(stringify!($name), n, &args),
                        Grid::Cfg(c) => self.0.launch_cfg(stringify!($name), c, &args),
                    }
                }
            )*
        }
    };
}

kernels! {
    /// Decode n elements: fmt 0 E4M3, 1 UE8M0, 2 E2M1, 3 BF16 bits, 4 F16 bits.
    "formats.cu" fn decode_bytes(inp: ptr, n: u64, fmt: i32, out: ptr);
    /// Encode n floats: fmt 0 E4M3 satfinite, 1 E2M1, 2 BF16 bits.
    "formats.cu" fn encode_floats(inp: ptr, n: u64, fmt: i32, out: ptr);
    /// y = bf16(x) in f32 (y may be x), or BF16 bits at `out16` when it is not 0 (y unused).
    "formats.cu" fn round_bf16(x: ptr, y: ptr, n: u64, out16: ptr);
    "formats.cu" fn count_inexact_bf16(x: ptr, n: u64, cnt: ptr);
    /// y = bf16(y · mul) (round != 0) or y · mul.
    "formats.cu" fn scale_round(y: ptr, n: u64, mul: f32, round: i32);
    "formats.cu" fn rcp_approx_map(x: ptr, n: u64, out: ptr);
    "formats.cu" fn rcp_sweep(e: i32, count: ptr, first: ptr, cap: u32);
    "formats.cu" fn rcp_table(out: ptr);
    "formats.cu" fn dequant_nvfp4(packed: ptr, scales: ptr, nblocks: u64, global: f32, conv: i32, post: f32, post_mul: i32, swap: i32, out_kind: i32, out: ptr);
    "formats.cu" fn dequant_nvfp4_v2(packed: ptr, scales: ptr, nblocks: u64, global: f32, conv: i32, post: f32, post_mul: i32, swap: i32, out_kind: i32, out: ptr);
    "formats.cu" fn dequant_mxfp4(packed: ptr, scales: ptr, nblocks: u64, out_kind: i32, out: ptr);
    "formats.cu" fn dequant_fp8_block(w: ptr, scales: ptr, rows: u64, cols: u64, bm: u64, bn: u64, extra: i32, out_kind: i32, out: ptr);
    /// The generic decode of the format table (`checkpoint::formats::Decode` as data).
    "formats.cu" fn dequant_blocked(codes: ptr, elem: i32, scales: ptr, scale_code: i32, rows: u64, cols: u64, bm: u64, bn: u64, gmode: i32, global: f32, out_kind: i32, out: ptr);
    "formats.cu" fn convert_dense(w: ptr, n: u64, round: i32, out_kind: i32, out: ptr);
    "quant.cu" fn act_quant_nvfp4(x: ptr, nblocks: u64, g: f32, packed: ptr, scales: ptr, xq16: ptr, xhat: ptr, xhat_bf16: i32, health: ptr);
    "quant.cu" fn act_quant_nvfp4_v2(x: ptr, nblocks: u64, g: f32, packed: ptr, scales: ptr, xq16: ptr, xhat: ptr, xhat_bf16: i32, health: ptr);
    "quant.cu" fn act_quant_nvfp4_v3(x: ptr, nblocks: u64, g: f32, packed: ptr, scales: ptr, xq16: ptr, xhat: ptr, xhat_bf16: i32, health: ptr);
    "quant.cu" fn act_quant_nvfp4_seg(x: ptr, segs: ptr, packed: ptr, scales: ptr, xq16: ptr, xhat: ptr, xhat_bf16: i32);
    "quant.cu" fn act_quant_fp8(x: ptr, rows: u64, cols: u64, non_pow2: i32, out: ptr);
    "quant.cu" fn act_quant_mxfp8(x: ptr, rows: u64, cols: u64, out: ptr);
    "quant.cu" fn kv_cache_fp8(x: ptr, rows: u64, cols: u64, nope: u64, group: u64, out: ptr);
    "stats.cu" fn fused_stats(x: ptr, r: ptr, n: u64, acc: ptr, cnt: ptr);
    "stats.cu" fn stats_pick(x: ptr, r: ptr, n: u64, cnt: ptr, out: ptr);
    "stats.cu" fn gather_rows(x: ptr, rows: ptr, nrows: u64, d: u64, out: ptr);
    "stats.cu" fn swiglu_clamp(g: ptr, u: ptr, n: u64, limit: f32, round: i32, out: ptr);
    "stats.cu" fn moe_combine(y: ptr, slot_row: ptr, slot_w: ptr, t: u64, k: u64, d: u64, out: ptr);
    "stats.cu" fn to_f64(inp: ptr, bf16: i32, rows: u64, cols: u64, ld: u64, out: ptr);
    "stats.cu" fn from_f64(inp: ptr, rows: u64, cols: u64, ld: u64, out: ptr);
    "stats.cu" fn gemm_small_f64(x: ptr, w: ptr, bf: i32, m: u64, n: u64, k: u64, ldx: u64, y: ptr, ldy: u64);
    "stats.cu" fn moe_gemm_f64(x: ptr, xbf: i32, ldx: u64, tiles: ptr, n: u64, k: u64, y: ptr, ldy: u64);
    "stats.cu" fn moe_mma_f64(x: ptr, xbf: i32, ldx: u64, tiles: ptr, n: u64, k: u64, y: ptr, ldy: u64);
    "stats.cu" fn moe_mmt_f64(x: ptr, xbf: i32, ldx: u64, tiles: ptr, n: u64, k: u64, y: ptr, ldy: u64);
    "layer.cu" fn row_rms(x: ptr, rows: u64, cols: u64, eps: f32, r: ptr);
    "layer.cu" fn rms_apply(x: ptr, rows: u64, cols: u64, r: ptr, w: ptr, round: i32, out: ptr);
    /// `mode`: bit 0 inverse, bit 1 half-split pairs (`ROPE_INVERSE`, `ROPE_SPLIT` in backend/layer.rs).
    "layer.cu" fn rope_rows(x: ptr, rows: u64, nh: u64, dh: u64, off: u64, half: u64, cs: ptr, sn: ptr, mode: i32);
    "layer.cu" fn hc_coeffs(m: ptr, t: u64, mix: u64, hc: u64, scale: ptr, base: ptr, iters: u64, eps: f32, pre: ptr, post: ptr, comb: ptr);
    "layer.cu" fn hc_wsum(x: ptr, coef: ptr, t: u64, hc: u64, d: u64, round: i32, y: ptr);
    "layer.cu" fn hc_post(y: ptr, x: ptr, post: ptr, comb: ptr, t: u64, hc: u64, d: u64, round: i32, out: ptr);
    "layer.cu" fn attn_core(q: ptr, kv: ptr, cmp: ptr, sel: ptr, kk: u64, has_sel: i32, ratio: u64, sink: ptr, t: u64, h: u64, dh: u64, n_c: u64, win: u64, max_keys: u64, q0: u64, kv0: u64, scale: f32, out: ptr);
    "layer.cu" fn attn_gather(kv: ptr, cmp: ptr, sel: ptr, kk: u64, has_sel: i32, ratio: u64, t: u64, dh: u64, n_c: u64, win: u64, max_keys: u64, q0: u64, kv0: u64, nk: ptr, kg: ptr);
    "layer.cu" fn attn_softmax(s: ptr, nk: ptr, sink: ptr, rows: u64, h: u64, max_keys: u64, scale: f32, pr: ptr);
    "layer.cu" fn compress_pool(a: ptr, g: ptr, ape: ptr, n_c: u64, dc: u64, ratio: u64, out: ptr);
    "layer.cu" fn indexer_reduce(s: ptr, w: ptr, t: u64, hi: u64, m: u64, ld: u64, out: ptr);
    "layer.cu" fn indexer_scores(q: ptr, ki: ptr, w: ptr, t: u64, hi: u64, di: u64, n_c: u64, out: ptr);
    /// One CUDA block of 256 threads per query of the block (`Grid::Cfg`).
    "layer.cu" fn indexer_topk(sc: ptr, rows: u64, ld: u64, t0: u64, ratio: u64, n_c: u64, kk: u64, out: ptr);
    "layer.cu" fn sel_lists(sel: ptr, t: u64, kk: u64, n_c: u64, lists: ptr, bad: ptr);
    "layer.cu" fn route_topk(logits: ptr, bias: ptr, t: u64, e: u64, k: u64, f: i32, norm: i32, rs: f32, given: ptr, wts: ptr, idx: ptr);
    "layer.cu" fn add_f32(a: ptr, b: ptr, n: u64, out: ptr);
    "layer.cu" fn copy_cols(x: ptr, rows: u64, cols: u64, c0: u64, w: u64, out: ptr);
    "layer.cu" fn mla_kv(kvb: ptr, kva: ptr, t: u64, h: u64, nope: u64, rope: u64, dv: u64, lora: u64, k: ptr, v: ptr);
    /// `alpha_bits`: the f64 bits of the GLU's α (`device::family::GLU_ALPHA`).
    "layer.cu" fn glu_oss(gp: ptr, up: ptr, stride: u64, n: u64, limit: f32, alpha_bits: u64, round: i32, out: ptr);
    /// One CUDA block per (query, head) task, grid-stride; dynamic shared memory (`Grid::Cfg`).
    "layer.cu" fn gqa_attn(q: ptr, k: ptr, v: ptr, sinks: ptr, has_sink: i32, t: u64, q0: u64, h: u64, kvh: u64, dq: u64, dv: u64, win: u64, scale: f32, round: i32, out: ptr);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every `extern "C" __global__` kernel of kernels/*.cu has a launcher with its number of
    /// parameters, and every launcher a kernel.
    #[test]
    fn every_kernel_has_a_launcher_with_its_arity() {
        let src = super::super::image::source();
        let mut found: Vec<(String, usize)> = src
            .split("extern \"C\" __global__")
            .skip(1)
            .map(|k| {
                let head = &k[..k.find('{').expect("a body")];
                let open = head.rfind('(').expect("parameters");
                let name = head[..open].split_whitespace().last().expect("a name");
                let params = &head[open + 1..head.rfind(')').expect(")")];
                let n = params.split(',').filter(|p| !p.trim().is_empty()).count();
                (name.to_string(), n)
            })
            .collect();
        let mut want: Vec<(String, usize)> =
            ARITY.iter().map(|(k, n)| (k.to_string(), *n)).collect();
        found.sort();
        want.sort();
        assert_eq!(found, want);
    }
}
