#!/bin/bash
# GPU machine check, one command: kernel self-test against the CPU reference, kernel bandwidth,
# whole-run agreement CPU vs CUDA, then (STAGE=flash) a V4-Flash-dimension checkpoint end to end.
# Usage (on the GPU machine, from the repository root, with the release binary carried over):
#   OUT=/tmp/out bash probes/device/gpu_check.sh            # self-test + bandwidth
#   OUT=/tmp/out STAGE=flash bash probes/device/gpu_check.sh # + Flash run timings
set -u
B=${B:-target/release/nvfp4-probe}
OUT=${OUT:-/tmp/nvfp4-probe-out}
STAGE=${STAGE:-selftest}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1
nproc >> "$OUT/gpu.txt"; free -g >> "$OUT/gpu.txt"
if [ "$STAGE" != "flash-only" ]; then
  ( time timeout 300 $B selftest --backend cuda --bench ${BENCH_GIB:-2} --json "$OUT/selftest.json" ) > "$OUT/selftest.txt" 2>&1
  echo "selftest rc=$?" >> "$OUT/selftest.txt"
  tail -5 "$OUT/selftest.txt"
fi
if [ "$STAGE" = "flash" ] || [ "$STAGE" = "flash-only" ]; then
  F=${FLASH_DIR:-/tmp/flash5}
  FMT=${FLASH_FORMAT:-modelopt-nvfp4}
  NL=${FLASH_LAYERS:-5}
  if [ ! -f "$F/config.json" ]; then
    ( time $B synth --preset flash-layer --format $FMT --layers $NL --out $F ${FLASH_FAULT:+--fault $FLASH_FAULT} ) > "$OUT/synth.txt" 2>&1
  fi
  du -sb "$F" >> "$OUT/synth.txt"
  L="0..$((NL-1))"
  # warm page cache: read once, then time runs
  cat $F/*.safetensors > /dev/null
  for i in 1 2 3; do
    ( /usr/bin/time -v $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet \
        ${i:+--json $OUT/flash_run$i.json} ) > "$OUT/flash_run$i.txt" 2>&1
  done
  if [ -n "${COLD:-}" ]; then
    sync; echo 3 > /proc/sys/vm/drop_caches 2>/dev/null && \
      ( /usr/bin/time -v $B run --model $F --layers $L --seq-len 128 --backend cuda --quiet --json $OUT/flash_cold.json ) > "$OUT/flash_cold.txt" 2>&1
  fi
  tail -3 "$OUT"/flash_run*.txt
fi
