#!/bin/bash
# The physical floors of V4-Flash-dimension runs (issue 22 item 3), binary B on the GPU machine:
# for each of TOKENS (and --chunk CHUNK at the token counts in CHUNKED), a warm run with
# NVFP4_PROBE_PROFILE=1; its `floors:` line states the GEMM-class work (exact f64 GEMMs, routed
# experts, attention products, indexer scores) at the FP64 DGEMM and FP32 SGEMM rates measured
# there and then, and the bytes uploaded at the measured pinned host→device rate. The runner's
# time is the `ops, N s` of the same run (the profile's event timing adds to it: compare with a
# run without the profile, TIMED=1).
# Usage: OUT=/tmp/fl B=target/release/nvfp4-probe TOKENS="128 4096 16384" CHUNKED=4096 bash probes/device/floors.sh
set -u
OUT=${OUT:-/tmp/fl}; B=${B:-target/release/nvfp4-probe}; F=${FLASH_DIR:-/tmp/flash}
TOKENS=${TOKENS:-"128 4096 16384"}; CHUNKED=${CHUNKED:-4096}; CHUNK=${CHUNK:-2048}; TIMED=${TIMED:-1}
mkdir -p "$OUT"
[ -f "$F/config.json" ] || $B synth --preset flash-layer --format modelopt-nvfp4 --layers 5 --out $F > $OUT/synth.txt 2>&1
cat $F/*.safetensors > /dev/null
one() {
  local tag=$1; shift
  NVFP4_PROBE_PROFILE=1 timeout 300 $B run --model $F --layers 0..4 --backend cuda --quiet "$@" > $OUT/$tag.txt 2>&1
  echo "$tag rc=$? runner(profiled) $(grep -oE 'ops, [0-9.]+ s' $OUT/$tag.txt | tail -1)"
  grep -E "^floors:|^gpu device time by op kind" $OUT/$tag.txt | cut -c1-600
  if [ "$TIMED" = 1 ]; then
    timeout 300 $B run --model $F --layers 0..4 --backend cuda --quiet "$@" > $OUT/${tag}_plain.txt 2>&1
    echo "$tag runner(plain) $(grep -oE 'ops, [0-9.]+ s' $OUT/${tag}_plain.txt | tail -1)"
  fi
}
for t in $TOKENS; do one flash_$t --seq-len $t; done
for t in $CHUNKED; do one flash_${t}_chunk$CHUNK --seq-len $t --chunk $CHUNK; done
