#!/bin/bash
# Host-time breakdown of the warm Flash run (NVFP4_PROBE_PROFILE=1 spans, the loader's stats, and a
# timeline of ops, loader batches and waits per run: $OUT/timeline*.jsonl) on the GPU machine.
#   OUT=/tmp/out [REPS=2] [KT=1] bash probes/device/prof.sh
set -u
B=${B:-target/release/nvfp4-probe}
OUT=${OUT:-/tmp/out}; F=${FLASH_DIR:-/tmp/flash}; NL=${FLASH_LAYERS:-5}
mkdir -p "$OUT"
[ -f "$F/config.json" ] || ( time $B synth --preset flash-layer --format ${FLASH_FORMAT:-modelopt-nvfp4} --layers $NL --out $F ) > "$OUT/synth.txt" 2>&1
cat $F/*.safetensors > /dev/null
for i in $(seq ${REPS:-2}); do
  ( NVFP4_PROBE_TIMELINE=$OUT/timeline$i.jsonl NVFP4_PROBE_PROFILE=1 /usr/bin/time -v $B run --model $F --layers 0..$((NL-1)) --seq-len 128 --backend cuda --quiet --json $OUT/prof$i.json ) > "$OUT/prof$i.txt" 2>&1
  grep -E "ops,|profile|^loader|Elapsed" "$OUT/prof$i.txt" | cut -c1-2500
done
if [ "${KT:-1}" = 1 ]; then
  ( NVFP4_PROBE_KERNEL_TIME=1 NVFP4_PROBE_PROFILE=1 $B run --model $F --layers 0..$((NL-1)) --seq-len 128 --backend cuda --quiet ) > "$OUT/kt.txt" 2>&1
  grep -E "ops,|device time|host spans" "$OUT/kt.txt" | cut -c1-2500
fi
