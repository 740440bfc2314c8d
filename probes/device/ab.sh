#!/bin/bash
# A/B(/C) of binaries or kernel settings on the same machine and the same V4-Flash-dimension
# checkpoint, interleaved (machines differ by up to 60 % in GPU and disk speed between calls, so
# only same-call numbers compare). Warm page cache. Usage (GPU machine, repository root):
#   OUT=/tmp/out A=target/prev/nvfp4-probe B=target/release/nvfp4-probe [C=... C_ENV="X=1"] \
#     REPS=3 [TOKENS=128] [FLASH_DIR=/tmp/flash FLASH_LAYERS=5] bash probes/device/ab.sh
# (FLASH_DIR may name any checkpoint, e.g. the V3 one of v3_check.sh with FLASH_LAYERS=2)
# Prints per run: variant, process wall seconds, runner seconds; then each variant's device time
# per kernel (NVFP4_PROBE_KERNEL_TIME=1) and a field-by-field diff of their reports against A's.
set -u
OUT=${OUT:-/tmp/ab}; F=${FLASH_DIR:-/tmp/flash}; REPS=${REPS:-3}; T=${TOKENS:-128}; NL=${FLASH_LAYERS:-5}
mkdir -p "$OUT"
[ -f "$F/config.json" ] || ${B} synth --preset flash-layer --format ${FLASH_FORMAT:-modelopt-nvfp4} --layers $NL --out $F > "$OUT/synth.txt" 2>&1
cat $F/*.safetensors > /dev/null
VS="A B"; [ -n "${C:-}" ] && VS="A B C"
bin() { eval echo \${$1}; }
envs() { eval echo \${$1_ENV:-}; }
run() { # variant json
  env $(envs $1) /usr/bin/time -f "%e" -o "$OUT/t.txt" timeout 300 $(bin $1) run --model $F --layers 0..$((NL-1)) --seq-len $T --backend cuda --quiet --json $2 > "$OUT/r.txt" 2>&1
  echo "$1 process $(cat $OUT/t.txt) s; runner $(grep -oE 'ops, [0-9.]+ s' $OUT/r.txt)"
}
for i in $(seq $REPS); do for v in $VS; do run $v $OUT/$v.json; done; done
for v in $VS; do
  env $(envs $v) NVFP4_PROBE_KERNEL_TIME=1 NVFP4_PROBE_PROFILE=1 timeout 300 $(bin $v) run --model $F --layers 0..$((NL-1)) --seq-len $T --backend cuda --quiet 2>&1 | grep -E "device time|^profile|^loader" | sed "s/^/$v /" | cut -c1-2400
done
for v in $VS; do [ $v != A ] && { echo "diff A $v:"; python3 probes/device/run_diff.py $OUT/A.json $OUT/$v.json; }; done
