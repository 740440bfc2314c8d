#!/bin/bash
# Where the warm Flash run's time goes beyond the GPU's work, on the GPU machine: two timed runs with
# a timeline each, one run with device time per op (NVFP4_PROBE_KERNEL_TIME=1), then per op the
# wall in the timed run against the device time (probes/device/timeline.py). Extra variants run
# with the environment in VARIANTS (space-separated NAME=VALUE items, one run each, e.g.
# "CUDA_MODULE_LOADING=EAGER"). Everything lands in $OUT/gaps.txt and $OUT/timelines.tgz.
#   OUT=/tmp/out [VARIANTS="..."] [TOKENS=128] [MIN_MS=8] bash probes/device/gaps.sh
set -u
B=${B:-target/release/nvfp4-probe}
OUT=${OUT:-/tmp/out}; F=${FLASH_DIR:-/tmp/flash}; NL=${FLASH_LAYERS:-5}; T=${TOKENS:-128}; MIN_MS=${MIN_MS:-8}
W=$(mktemp -d); mkdir -p "$OUT"
[ -f "$F/config.json" ] || $B synth --preset flash-layer --format ${FLASH_FORMAT:-modelopt-nvfp4} --layers $NL --out $F > "$W/synth.txt" 2>&1
cat $F/*.safetensors > /dev/null
run() { # tag, env...
  local tag=$1; shift
  ( env "$@" NVFP4_PROBE_TIMELINE=$W/$tag.jsonl NVFP4_PROBE_PROFILE=1 /usr/bin/time -f "process %e s" $B run --model $F --layers 0..$((NL-1)) --seq-len $T --backend cuda --quiet --json $W/$tag.json ) > "$W/$tag.txt" 2>&1
  echo "== $tag: $(grep -oE '[0-9]+ ops, [0-9.]+ s' $W/$tag.txt); $(grep -E '^process' $W/$tag.txt); $(grep -oE 'backend ready' $W/$tag.txt >/dev/null && grep -E 'profile: +[0-9.]+ s +backend ready' $W/$tag.txt | grep -oE '[0-9.]+ s')  to backend ready"
}
{
  run a; run b
  run kt NVFP4_PROBE_KERNEL_TIME=1
  grep -E "^profile \(s|^gpu device time|^loader" $W/b.txt $W/kt.txt | cut -c1-1200
  for v in ${VARIANTS:-}; do run "${v%%=*}" "$v"; python3 probes/device/timeline.py $W/${v%%=*}.jsonl 20 | head -12; done
  echo "== timeline b (ops over 8 ms) vs device time of kt"
  python3 probes/device/timeline.py $W/b.jsonl $MIN_MS $W/kt.jsonl $W/b.json
} > "$OUT/gaps.txt" 2>&1
( cd $W && tar czf "$OUT/timelines.tgz" *.jsonl *.txt )
cat "$OUT/gaps.txt"
