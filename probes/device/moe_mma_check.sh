#!/bin/bash
# The grouped routed-experts GEMM on the FP64 tensor cores (moe_mma_f64) against the FMA kernel
# (NVFP4_PROBE_MOE_KERNEL=fma), binary B on the GPU machine. Stages (STAGES):
#   kb        rebuild the shipped CUBINs (KB = the build_kernels example binary) into $OUT/kb
#   selftest  every kernel against the CPU reference (both grouped kernels), no bandwidth bench
#   tiny      whole tiny runs CPU vs CUDA in NVFP4 (both conventions) and MXFP4, every served profile
#   v3        V3 release preset (synth if absent): RUNS warm runs with each kernel, one profiled,
#             and run_diff of the two kernels' reports (0 differing fields expected)
#   flash     V4-Flash 5 layers (synth if absent): at each of TOKENS, a run with each kernel (the FMA
#             one sends experts of > 64 rows per expert through cuBLAS), run_diff, and the floors line
# Usage: OUT=/tmp/mm B=target/release/nvfp4-probe STAGES="kb selftest tiny v3 flash" bash probes/device/moe_mma_check.sh
set -u
OUT=${OUT:-/tmp/mm}; B=${B:-target/release/nvfp4-probe}; KB=${KB:-devcarry/kb}
STAGES=${STAGES:-"selftest tiny"}; RUNS=${RUNS:-2}; TOKENS=${TOKENS:-"128 4096"}
V3=${V3_DIR:-/tmp/v3}; F=${FLASH_DIR:-/tmp/flash}
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has kb; then
  mkdir -p kernels/bin "$OUT/kb"
  LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-} $KB > "$OUT/kb.txt" 2>&1
  echo "kb rc=$?: $(tail -2 $OUT/kb.txt | tr '\n' ' ')"; cp kernels/bin/* "$OUT/kb/"
fi
if has selftest; then
  timeout 300 $B selftest --backend cuda --json "$OUT/selftest.json" > "$OUT/selftest.txt" 2>&1
  echo "selftest rc=$?"; grep -E "^(kernels|whole|selftest)|FAIL|grouped experts GEMM" "$OUT/selftest.txt" | cut -c1-250
fi
if has tiny; then
  for fmt in modelopt-nvfp4 ct-nvfp4 mxfp4; do
    [ -f /tmp/tiny_$fmt/config.json ] || $B synth --preset tiny --format $fmt --out /tmp/tiny_$fmt > /dev/null 2>&1
    timeout 300 $B selftest --backend cuda --model /tmp/tiny_$fmt > "$OUT/tiny_$fmt.txt" 2>&1
    echo "tiny $fmt rc=$?: $(grep -E '^whole|^selftest' $OUT/tiny_$fmt.txt | tail -2 | tr '\n' ' ' | cut -c1-300)"
  done
fi
runk() {  # runk TAG KERNEL DIR LAYERS TOKENS [env...]
  local tag=$1 k=$2 d=$3 l=$4 t=$5; shift 5
  env NVFP4_PROBE_MOE_KERNEL=$k "$@" timeout 400 $B run --model $d --layers $l --seq-len $t --backend cuda --quiet --json $OUT/$tag.json > $OUT/$tag.txt 2>&1
  echo "$tag rc=$?: $(grep -oE 'ops, [0-9.]+ s' $OUT/$tag.txt | tail -1); $(grep -E '^first divergent|^no op diverges' $OUT/$tag.txt | head -1 | cut -c1-100)"
}
if has v3; then
  if [ ! -f "$V3/config.json" ]; then
    $B synth --family deepseek-v3 --preset release --format modelopt-nvfp4 --out $V3 > $OUT/v3_synth.txt 2>&1; echo "v3 synth rc=$?"
  fi
  cat $V3/*.safetensors > /dev/null
  for i in $(seq 1 $RUNS); do runk v3_mma_$i mma $V3 0..1 128; runk v3_fma_$i fma $V3 0..1 128; done
  python3 probes/device/run_diff.py $OUT/v3_fma_1.json $OUT/v3_mma_1.json > $OUT/v3_diff.txt 2>&1; echo "v3 run_diff rc=$?: $(tail -1 $OUT/v3_diff.txt | cut -c1-200)"
  NVFP4_PROBE_PROFILE=1 NVFP4_PROBE_KERNEL_TIME=1 $B run --model $V3 --layers 0..1 --seq-len 128 --backend cuda --quiet > $OUT/v3_ktime.txt 2>&1
  grep -E "ops, |moe_|L1.ffn.experts" $OUT/v3_ktime.txt | head -8 | cut -c1-300
  NVFP4_PROBE_PROFILE=1 $B run --model $V3 --layers 0..1 --seq-len 128 --backend cuda --quiet > $OUT/v3_prof.txt 2>&1
  grep -E "^floors:" $OUT/v3_prof.txt | cut -c1-400
fi
if has flash; then
  [ -f "$F/config.json" ] || { $B synth --preset flash-layer --format modelopt-nvfp4 --layers 5 --out $F > $OUT/flash_synth.txt 2>&1; echo "flash synth rc=$?"; }
  cat $F/*.safetensors > /dev/null
  for t in $TOKENS; do
    runk flash_${t}_mma mma $F 0..4 $t; runk flash_${t}_fma fma $F 0..4 $t
    python3 probes/device/run_diff.py $OUT/flash_${t}_fma.json $OUT/flash_${t}_mma.json > $OUT/flash_${t}_diff.txt 2>&1; echo "flash $t run_diff rc=$?: $(tail -1 $OUT/flash_${t}_diff.txt | cut -c1-200)"
    NVFP4_PROBE_PROFILE=1 timeout 400 $B run --model $F --layers 0..4 --seq-len $t --backend cuda --quiet > $OUT/flash_${t}_prof.txt 2>&1
    grep -E "^floors:|^profile \(s, ops" $OUT/flash_${t}_prof.txt | cut -c1-600
  done
  rm -f $OUT/flash_*_mma.json $OUT/flash_*_fma.json
fi
