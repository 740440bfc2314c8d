#!/bin/bash
# The attention and the indexer's scores as DGEMMs (default) against attn_core / indexer_scores
# (NVFP4_PROBE_ATTN=kernel), binary B on the GPU machine: the self-test (both, against the CPU
# reference), the tiny model CPU vs CUDA, then on the V4-Flash 5-layer checkpoint (synth if absent)
# at each of TOKENS a run with each and run_diff of the reports, and a kernel-time profile.
# Usage: OUT=/tmp/ab B=target/release/nvfp4-probe TOKENS="4096" bash probes/device/attn_blas_check.sh
set -u
OUT=${OUT:-/tmp/ab}; B=${B:-target/release/nvfp4-probe}; F=${FLASH_DIR:-/tmp/flash}
TOKENS=${TOKENS:-4096}; SELFTEST=${SELFTEST:-1}
mkdir -p "$OUT"
if [ "$SELFTEST" = 1 ]; then
  timeout 300 $B selftest --backend cuda > "$OUT/selftest.txt" 2>&1
  echo "selftest rc=$?"; grep -E "^(kernels|whole|selftest)|FAIL" "$OUT/selftest.txt" | cut -c1-250
  [ -f /tmp/tiny/config.json ] || $B synth --preset tiny --out /tmp/tiny > /dev/null 2>&1
  timeout 300 $B selftest --backend cuda --model /tmp/tiny --seq-len 300 > "$OUT/tiny.txt" 2>&1
  echo "tiny T=300 rc=$?: $(grep -E '^whole' $OUT/tiny.txt | tail -1 | cut -c1-250)"
fi
[ -f "$F/config.json" ] || { $B synth --preset flash-layer --format modelopt-nvfp4 --layers 5 --out $F > $OUT/flash_synth.txt 2>&1; echo "flash synth rc=$?"; }
cat $F/*.safetensors > /dev/null
for t in $TOKENS; do
  for a in blas kernel; do
    env $([ $a = kernel ] && echo NVFP4_PROBE_ATTN=kernel) timeout 400 $B run --model $F --layers 0..4 --seq-len $t --backend cuda --quiet --json /tmp/ab_${t}_$a.json > $OUT/flash_${t}_$a.txt 2>&1
    echo "flash $t $a rc=$?: $(grep -oE 'ops, [0-9.]+ s' $OUT/flash_${t}_$a.txt | tail -1); $(grep -E '^first divergent|^no op diverges' $OUT/flash_${t}_$a.txt | head -1 | cut -c1-100)"
  done
  python3 probes/device/run_diff.py /tmp/ab_${t}_kernel.json /tmp/ab_${t}_blas.json > $OUT/flash_${t}_diff.txt 2>&1
  echo "flash $t run_diff rc=$?: $(head -1 $OUT/flash_${t}_diff.txt | cut -c1-200)"
  NVFP4_PROBE_KERNEL_TIME=1 NVFP4_PROBE_PROFILE=1 timeout 400 $B run --model $F --layers 0..4 --seq-len $t --backend cuda --quiet > $OUT/flash_${t}_kt.txt 2>&1
  grep -E "^gpu device time by op kind|^gpu device time \(events" $OUT/flash_${t}_kt.txt | cut -c1-900
  NVFP4_PROBE_PROFILE=1 timeout 400 $B run --model $F --layers 0..4 --seq-len $t --backend cuda --quiet > $OUT/flash_${t}_prof.txt 2>&1
  grep -E "ops, |^floors:|^profile \(s, ops" $OUT/flash_${t}_prof.txt | cut -c1-600
done
